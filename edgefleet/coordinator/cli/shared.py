"""What every command shares: the coordinator's configuration from the global flags, its keys from
``--fleet-key`` and ``--board-keys``, and the check that the terminal library is installed."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from edgefleet.coordinator.cli.config import config_locations, default_config_path, load_coordinator_config
from edgefleet.protocol.address import parse_broker
from edgefleet.protocol.errors import EdgeTrainError
from edgefleet.transport.fleet_key import add_board_keys

if TYPE_CHECKING:
    from edgefleet.coordinator.cli.config import CoordinatorConfig

log = logging.getLogger(__name__)


def config_file(args: argparse.Namespace) -> Path | None:
    """``--config``, else the default file that is there (see :func:`~edgefleet.coordinator.cli.config.config_locations`);
    logs which (``-v`` shows it).

    Raises:
        ConfigError: ``$EDGEFLEET_CONFIG`` names a file that does not exist.
    """
    explicit: Path | None = getattr(args, "config", None)
    if explicit is not None:
        log.info("config file %s (--config)", explicit)
        return explicit
    found = default_config_path()
    if found is None:
        log.info("no config file (looked for %s); using defaults and the command line",
                 ", ".join(str(path) for path, _ in config_locations()))
        return None
    log.info("config file %s (%s)", *found)
    return found[0]


def load_config(args: argparse.Namespace) -> CoordinatorConfig:
    """The configuration ``--config`` (else the default file), ``--broker`` (else ``$EDGEFLEET_BROKER``) and the command's
    ``--fleet-key`` say."""
    broker = parse_broker(args.broker, what="--broker") if args.broker else None
    return load_coordinator_config(config_file(args), broker=broker, fleet_key_file=getattr(args, "fleet_key", None))


FLEET_KEY_HELP = ("the coordinator's key file that signs commands: an ed25519-private key (boards hold its public key); "
                  "a legacy shared HMAC key still works (default: [security] fleet_key_file)")


def add_board_keys_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, what: str = "") -> None:
    """Add ``--board-keys DIR``: check job events against each board's own public key."""
    parser.add_argument("--board-keys", type=Path, metavar="DIR",
                        help=f"{what}check every job event against its board's public key in DIR/<board_id>.pub (the Ansible "
                             "role fetches them into credentials/board-keys/): unsigned or forged events are dropped with "
                             "a warning, and a board without a key there is refused (default: [security] board_keys_dir, "
                             "else events are not checked)")


def coordinator_keys(args: argparse.Namespace, cfg: CoordinatorConfig, **missing: str) -> bytes:
    """The coordinator's keys (``fleet_key``): ``--fleet-key`` (else the config's), with ``--board-keys`` (else the
    config's ``[security] board_keys_dir``) if given.

    ``missing``: the message when no key file is configured (``CoordinatorConfig.fleet_key``).

    Raises:
        ConfigError: naming the file or directory and the fix.
    """
    key = cfg.fleet_key(**missing)
    directory = getattr(args, "board_keys", None)
    if directory is None and cfg.security.board_keys_dir:  # the config file's, when the flag is not given
        directory = Path(cfg.security.board_keys_dir)
    if directory is None:
        return key
    return add_board_keys(key, directory)


def require_rich() -> None:
    """Raises EdgeTrainError saying how to install rich when it is missing."""
    try:
        # is the optional coordinator extra installed?
        import rich  # noqa: F401
    except ImportError:
        raise EdgeTrainError("edge-coordinator needs the 'rich' package: pip install '.[coordinator]' in the edgefleet checkout") from None



def board_count(text: str) -> int:
    """``--max-boards N``: a whole number of boards of at least 1 (argparse names the flag with the error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of boards of at least 1")
    return value

__all__ = ["FLEET_KEY_HELP", "add_board_keys_arg", "board_count", "config_file", "coordinator_keys", "load_config", "require_rich"]
