"""The coordinator role provisions the Grafana dashboards of grafana/ when it is given Grafana's
provisioning directory: the dashboards' JSON as shipped, and a file provider that points Grafana at
them. The role's own tasks (playbooks/provision_grafana.yml), run on this machine into temporary
directories; a second run changes nothing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from tests.deploy.playbook import run_playbook
from tests.deploy.tools import ANSIBLE_DIR, REPO, require_root

PLAYBOOK = Path(__file__).parent / "playbooks" / "provision_grafana.yml"


def test_the_role_installs_the_dashboards_and_a_provider_that_finds_them(tmp_path: Path) -> None:
    require_root()  # the files are installed owned by root, as on a real host
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    provisioning, dashboards = tmp_path / "provisioning", tmp_path / "dashboards" / "edgefleet"
    extra: dict[str, object] = {"roles_dir": str(ANSIBLE_DIR / "roles"),
                                "coordinator_grafana_provisioning_dir": str(provisioning),
                                "coordinator_grafana_dashboards_dir": str(dashboards), "coordinator_grafana_service": ""}
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0"}

    first = run_playbook(inventory, playbook=PLAYBOOK, extra_vars=extra, env=env, timeout_s=180)
    again = run_playbook(inventory, playbook=PLAYBOOK, extra_vars=extra, env=env, timeout_s=180)

    assert first.returncode == 0, first.summary()
    shipped = sorted((REPO / "grafana").glob("*.json"))
    assert sorted(p.name for p in dashboards.iterdir()) == [p.name for p in shipped]
    assert all((dashboards / p.name).read_text() == p.read_text() for p in shipped)
    provider = yaml.safe_load((provisioning / "dashboards" / "edgefleet.yml").read_text())
    assert provider["apiVersion"] == 1
    assert [(p["type"], p["folder"], p["options"]["path"]) for p in provider["providers"]] == \
        [("file", "edgefleet", str(dashboards))]
    assert again.returncode == 0 and again.recap["localhost"]["changed"] == 0, again.changed_tasks()
