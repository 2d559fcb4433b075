#!/usr/bin/env bash
# The README's set-up, run as a new user would run it on a fresh Debian 12 root: scripts/setup (the
# venv, CPU torch, [demo], and the demo), scripts/setup again (it must do nothing), checks of what it
# installed, scripts/test with a few of the tests, and a wheel and an sdist built from the folder and
# installed as the Ansible rollout installs them. A manual check, not part of the test suite: it
# downloads about 2 GB (the [test] extra brings Ansible) and takes about ten minutes.
# tests/packaging/test_setup_commands.py checks the scripts quickly.
#
# Usage, as root:
#   scripts/check_fresh_install.sh [--keep] [-- PYTEST_ARGS...]   # default tests: see DEFAULT_TESTS
#   scripts/check_fresh_install.sh --print-setup                   # the README's commands, as run
#
# The root: the deployment tests' cached debootstrap of bookworm (minbase with python3, systemd and
# ca-certificates; built on first use by tests/deploy/rootfs.py), copied. The README's commands run
# in it under systemd-nspawn, with the host's network, as a user with sudo, which a new board has
# (Raspberry Pi OS's first user does); a bare root has neither, so the check adds them first. What
# the check adds, and nothing else:
# - sudo and that user;
# - policy-rc.d, so that installing Mosquitto starts no daemon (the demo starts its own broker);
# - the host's resolver and local CA certificates (a TLS-inspecting proxy's);
# - the host's pip settings as the root's /etc/pip.conf, with the folders they name bound read-only
#   (scripts/fresh_root.py): pip in the root reaches the registries the way the host's pip does.
#   Where download.pytorch.org does not answer, scripts/setup says so and takes torch from the
#   places those settings name (here: a folder holding the CPU wheel).
# Needs: root, systemd-nspawn and debootstrap (bash .ci/install-deploy-tools), git, the registries.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
README="$REPO/README.md"
PYTHON=${PYTHON:-python3}
BOARD_USER=fresh
BOARD_HOME=/home/$BOARD_USER
CHECKOUT=$BOARD_HOME/edgefleet
# A few of the tests: packaging (the wheel, the README), the workloads (torch, Lightning, the digits)
# and a live fleet of agents on the README's Mosquitto.
DEFAULT_TESTS=(tests/packaging tests/workloads tests/integration/test_live_fleet.py)

die() { echo "check_fresh_install: $*" >&2; exit 2; }

# The fenced lines between <!-- NAME:begin --> and <!-- NAME:end --> in the README.
readme_block() {
  awk -v begin="<!-- $1:begin -->" -v end="<!-- $1:end -->" \
    'index($0, begin) == 1 {on = 1; next} index($0, end) == 1 {on = 0} on && !/^```/' "$README"
}

keep=false
tests=("${DEFAULT_TESTS[@]}")
while [ $# -gt 0 ]; do
  case "$1" in
    --print-setup) readme_block setup; exit 0 ;;
    --keep) keep=true; shift ;;
    --) shift; [ $# -gt 0 ] && tests=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (--print-setup, --keep, -- PYTEST_ARGS; --help says more)" ;;
  esac
done

setup=$(readme_block setup)
[ -n "$setup" ] || die "README.md has no set-up block: a bash block between <!-- setup:begin --> and <!-- setup:end -->"
mapfile -t setup_lines <<< "$setup"
[ ${#setup_lines[@]} -eq 2 ] && [[ ${setup_lines[0]} == scripts/setup* ]] && [[ ${setup_lines[1]} == scripts/test* ]] \
  || die "README.md's set-up block is not the two commands scripts/setup and scripts/test: $setup"
[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, systemd-nspawn): sudo $0"
nspawn=$(command -v systemd-nspawn || echo /usr/bin/systemd-nspawn)
[ -x "$nspawn" ] || die "systemd-nspawn is not installed: bash .ci/install-deploy-tools (as root)"

started=$SECONDS
phase() { printf '\n== %s (%d s)\n' "$1" $((SECONDS - started)); }

work=$(mktemp -d /var/tmp/edgefleet-fresh.XXXXXX)
root=$work/root
cleanup() {
  if $keep; then echo "kept the root: $root"; else rm -rf "$work"; fi
}
trap cleanup EXIT

phase "a fresh Debian 12 root"
(cd "$REPO" && "$PYTHON" scripts/fresh_root.py copy "$root")
mapfile -t pip_folders < <(cd "$REPO" && "$PYTHON" scripts/fresh_root.py pip-config "$root")
echo "the host's pip settings, as the root's /etc/pip.conf:"; sed 's/^/  /' "$root/etc/pip.conf"

# Run a command in the root as USER: the host's network, the pip folders read-only, no terminal.
machine=edgefleet-fresh-$$
in_root() {
  local user=$1; shift
  local args=(--quiet --register=no --keep-unit --console=pipe "--machine=$machine" "--directory=$root" "--user=$user"
              --setenv=LANG=C.UTF-8)
  local folder
  for folder in "${pip_folders[@]}"; do args+=("--bind-ro=$folder"); done
  "$nspawn" "${args[@]}" "$@"
}

phase "a user with sudo, as on a new board"
in_root root bash -euc "apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sudo >/dev/null
  useradd --create-home --shell /bin/bash $BOARD_USER
  echo '$BOARD_USER ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/$BOARD_USER && chmod 440 /etc/sudoers.d/$BOARD_USER"

phase "the checkout, as a clone has it (tracked and new files, nothing ignored)"
mkdir -p "$root$CHECKOUT"
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' file; do { [ -e "$file" ] || [ -L "$file" ]; } && printf '%s\0' "$file"; done |
  xargs -0 cp -P --parents -t "$root$CHECKOUT")

# One shell for all of it, as a user's terminal with no venv active. The set-up block's first command
# (scripts/setup) installs and runs the demo; its second (scripts/test) runs the tests given here.
session=$root$BOARD_HOME/session.sh
{
  echo 'set -eo pipefail'
  echo 'phase() { printf "\n== %s (%d s in the root)\n" "$1" "$SECONDS"; }'
  echo "cd $CHECKOUT"
  echo 'phase "the README'"'"'s set-up and demo: its first command, verbatim"'
  printf 'echo %q\n' "\$ ${setup_lines[0]}"
  echo '{'
  printf '%s\n' "${setup_lines[0]}"
  echo '} 2>&1 | tee ~/demo.log'
  echo 'grep -q "val accuracy" ~/demo.log || { echo "the demo printed no validation accuracy" >&2; exit 1; }'
  cat <<'CHECKS'
phase "what the set-up installed"
cd ~  # away from the checkout: the venv's package, not the folder
~/edgefleet/.venv/bin/python - <<'PY'
import importlib.metadata as metadata
import sys

import edgefleet
import torch

names = {dist.metadata["Name"].lower() for dist in metadata.distributions()}
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, edgefleet {edgefleet.__version__} "
      f"from {edgefleet.__file__}, {len(names)} distributions")
assert sys.prefix.endswith("/edgefleet/.venv"), f"not the set-up's venv: {sys.prefix}"
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build (CUDA {torch.version.cuda})"
cuda = sorted(name for name in names if name.startswith(("nvidia-", "cuda-")))
assert not cuda, f"CUDA libraries were installed: {cuda}"
tools = sorted(names & {"ansible", "ansible-core", "ansible-lint", "pytest"})
assert not tools, f"the set-up installed test or rollout tools: {tools}"
PY
~/edgefleet/.venv/bin/python -m pip check
du -sh ~/edgefleet/.venv
CHECKS
  echo "cd $CHECKOUT"
  echo 'phase "the set-up again: nothing left to do"'
  echo 'scripts/setup --no-demo 2>&1 | tee ~/setup-again.log'
  echo 'grep -q "nothing to do" ~/setup-again.log || { echo "a second scripts/setup installed something" >&2; exit 1; }'
  echo 'phase "a few of the tests: the set-up block'"'"'s second command, with them"'
  printf 'echo %q\n' "\$ ${setup_lines[1]%%#*}-p no:cacheprovider ${tests[*]}"
  printf '%s -p no:cacheprovider' "${setup_lines[1]%%#*}"; printf ' %q' "${tests[@]}"; echo
  cat <<'WHEEL'
phase "a wheel and an sdist from the folder, the wheel installed as the rollout does"
python3 -m venv ~/build-venv && ~/build-venv/bin/pip install -q build
# The sdist, then the wheel built from the sdist (so the sdist holds all it needs); the log only on failure.
~/build-venv/bin/python -m build --outdir ~/dist ~/edgefleet > ~/build.log 2>&1 || { tail -40 ~/build.log; exit 1; }
ls -l ~/dist
python3 -m venv ~/board-venv && ~/board-venv/bin/pip install -q ~/dist/edgefleet-*.whl
~/board-venv/bin/edge-agent --version
~/board-venv/bin/python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'the base wheel pulled in torch'"
phase "done"
WHEEL
} > "$session"
in_root root chown -R "$BOARD_USER:$BOARD_USER" "$BOARD_HOME"

phase "the session as $BOARD_USER (its own clock below)"
in_root "$BOARD_USER" --chdir="$BOARD_HOME" bash "$BOARD_HOME/session.sh"

phase "PASSED: the README's set-up works on a fresh Debian 12 root"
echo "root after the check: $(du -sh "$root" | cut -f1)"
