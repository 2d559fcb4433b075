"""A fresh Debian 12 root for scripts/check_fresh_install.sh, and the host's pip settings for it.

The root is the deployment tests' cached debootstrap (tests/deploy/rootfs.py: bookworm minbase with
python3, systemd and ca-certificates), copied, so the check and the image tests build it once.

pip inside must reach the package registries the way the host's pip does: through the host's
index, find-links and constraint settings (on a CI machine, local wheel folders and a mirror).
``pip-config`` writes them as the root's /etc/pip.conf and prints the folders they name, which the
caller binds read-only into the root at the same paths.

Usage (from the repository root, as root):
    python3 scripts/fresh_root.py copy DEST        # a private copy of the cached root at DEST
    python3 scripts/fresh_root.py pip-config ROOT  # ROOT/etc/pip.conf; prints one folder to bind a line
"""

from __future__ import annotations

import configparser
import io
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# pip settings whose values name files or folders on the host.
_PATH_KEYS = ("find-links", "extra-index-url", "index-url", "constraint", "requirement")
_CONFIG_LINE = re.compile(r"^(?P<section>[^.]*)\.(?P<key>[^=]+)=(?P<value>.*)$")


def copy_fresh_root(dest: Path) -> None:
    """Copy the cached debootstrap root to ``dest``, ready to install into (no daemons start)."""
    from tests.deploy.rootfs import cached_base_root, copy_root, prepare_for_build

    copy_root(cached_base_root(), dest)
    prepare_for_build(dest)


def host_pip_settings() -> dict[str, dict[str, str]]:
    """The host's effective pip settings, ``{section: {key: value}}``: its files, then its PIP_* variables."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    settings: dict[str, dict[str, str]] = {}
    environment: dict[str, str] = {}
    for line in listing.splitlines():
        found = _CONFIG_LINE.match(line.strip())
        if not found:
            continue
        value = found["value"].strip("'\"")
        if found["section"] == ":env:":
            environment[found["key"]] = value
        else:
            settings.setdefault(found["section"], {})[found["key"]] = value
    settings.setdefault("global", {}).update(environment)  # the environment wins over the files, as in pip
    return settings


def _local_folder(value: str) -> Path | None:
    """The host folder a path-like pip value needs inside the root, or None for a remote URL."""
    path = Path(value.removeprefix("file://")) if value.startswith(("file://", "/")) else None
    if path is None:
        return None
    if path.is_file():
        return path.parent
    # A file:// simple index links to its files beside it (../../files/x.whl): bind its parent.
    return path.parent if path.name == "simple" else path


def write_pip_config(root: Path, settings: dict[str, dict[str, str]]) -> list[Path]:
    """Write ``settings`` as ``root``/etc/pip.conf; return the host folders they name, to bind into the root."""
    folders: list[Path] = []
    for section in settings.values():
        for key in _PATH_KEYS:
            for value in section.get(key, "").split():
                folder = _local_folder(value)
                if folder is not None and folder.exists() and folder not in folders:
                    folders.append(folder)
    parser = configparser.ConfigParser(interpolation=None)
    for name, section in settings.items():
        parser[name] = section
    text = io.StringIO()
    parser.write(text)
    (root / "etc/pip.conf").write_text("# The build host's pip settings (scripts/fresh_root.py)\n" + text.getvalue())
    return folders


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("copy", "pip-config"):
        print(__doc__.split("Usage", 1)[1].strip(), file=sys.stderr)
        return 2
    target = Path(argv[1])
    if argv[0] == "copy":
        copy_fresh_root(target)
        return 0
    if not (target / "etc").is_dir():
        print(f"{target} is not a root file system (no etc/): give the root that 'copy' made", file=sys.stderr)
        return 2
    for folder in write_pip_config(target, host_pip_settings()):
        print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
