"""The agent's main loop: sample, publish, notify systemd, stop cleanly on SIGTERM."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import signal
import threading
import time
from pathlib import Path

from edgefleet import __version__
from edgefleet.agent.caps import reachable_address, read_caps
from edgefleet.agent.config import AgentConfig, nonce_file_path
from edgefleet.agent.energy import EnergyMeter, energy_file_path
from edgefleet.agent.home_assistant import HomeAssistantDiscovery
from edgefleet.agent.job_runner import JobRunner, ProgressLimiter, event_json
from edgefleet.agent.nonce_file import NonceFile
from edgefleet.agent.sdnotify import sd_notify
from edgefleet.agent.sensors import Sampler
from edgefleet.protocol.errors import DecodeError
from edgefleet.protocol.jobs import JobEvent
from edgefleet.protocol.messages import BoardStatus, TelemetrySample
from edgefleet.protocol.signing import CommandVerifier
from edgefleet.protocol.topics import caps_topic, cmd_topic, events_json_topic, events_topic, status_topic, telemetry_topic
from edgefleet.transport.fleet_key import load_board_key, load_command_keys
from edgefleet.transport.log_limit import LogLimiter, suppressed_text
from edgefleet.transport.mqtt_link import MqttLink, Will, agent_client_id

log = logging.getLogger(__name__)


class ExitCode(enum.IntEnum):
    """How ``edge-agent`` exits; systemd's unit does not restart on CONFIG."""

    OK = 0
    FAILURE = 1
    USAGE = 2
    CONFIG = 78  # EX_CONFIG: fix the file, restarting will not help


class Agent:
    """One board's connection, sampler and loop."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        prefix = cfg.broker.topic_prefix
        self.status_topic = status_topic(prefix, cfg.board_id)
        self.telemetry_topic = telemetry_topic(prefix, cfg.board_id)
        self.sampler = Sampler(
            board_id=cfg.board_id, interval_s=cfg.telemetry.interval_s, sysfs_root=Path(cfg.telemetry.sysfs_root),
            net_interfaces=cfg.telemetry.net_interfaces, power_kind=cfg.power.source,
            idle_w=cfg.power.idle_w, max_w=cfg.power.max_w, cpu_scope=cfg.telemetry.cpu_scope,
            disk_folders=disk_folders(cfg))
        self.energy = EnergyMeter(board_id=cfg.board_id, interval_s=cfg.telemetry.interval_s,
                                  record=energy_file_path(cfg.state_dir, cfg.board_id))
        first = self.sampler.read()  # primes the CPU and network deltas, and names the power source
        first = dataclasses.replace(first, energy_wh=self.energy.add(first.power_w))
        self.caps = read_caps(cfg.board_id, first.power_source, Path(cfg.telemetry.sysfs_root))
        self.discovery: HomeAssistantDiscovery | None = None
        if cfg.telemetry.home_assistant:
            self.discovery = HomeAssistantDiscovery(caps=self.caps, topic_prefix=prefix,
                                                    discovery_prefix=cfg.telemetry.home_assistant_prefix,
                                                    interval_s=cfg.telemetry.interval_s)
            self.discovery.observe(first)
            if self.discovery.node_id != cfg.board_id:  # the ACL's %u pattern does not cover it
                log.info("Home Assistant: a node_id may not hold a '.', so this board announces as %s; with the "
                         "shipped ACL add 'user %s' and 'topic write %s/+/%s/+/config' (the Ansible role does)",
                         self.discovery.node_id, cfg.board_id, cfg.telemetry.home_assistant_prefix, self.discovery.node_id)
        self._events_topic = events_topic(prefix, cfg.board_id)
        self._events_json_topic = events_json_topic(prefix, cfg.board_id)
        self._progress_json = ProgressLimiter()
        will = Will(self.status_topic, BoardStatus(state="offline", reason="connection lost").to_json())
        self.link = MqttLink(cfg.broker, client_id=agent_client_id(cfg.board_id), will=will,
                             on_connect=self._announce, on_message=self._on_message)
        self._stopping = False
        self._forged_status_log = LogLimiter(burst=1)
        verifier = None
        if cfg.security.fleet_key_file:
            keys = load_command_keys(Path(cfg.security.fleet_key_file))  # warns about a legacy or private key
            record = nonce_file_path(cfg)
            if record is None:
                log.warning("no state_dir: the nonces of accepted commands are kept in memory only, so a command "
                            "captured on the network could be replayed once within %g s of a restart; set state_dir",
                            cfg.security.max_command_age_s)
            verifier = CommandVerifier(keys, max_age_s=cfg.security.max_command_age_s,
                                       nonce_file=NonceFile(record) if record is not None else None).verify
        else:
            log.warning("no security.fleet_key_file: this board will refuse every training command")
        # Loaded now (a bad file stops the agent with its reason); the key is first used by the first event.
        self._sign_event = load_board_key(Path(cfg.security.board_key_file)) if cfg.security.board_key_file else None
        if self._sign_event is None:
            log.info("no security.board_key_file: job events are sent unsigned (a coordinator given --board-keys "
                     "refuses them)")
        self.jobs = JobRunner(board_id=cfg.board_id, verify=verifier, publish_event=self._publish_event,
                              set_busy=self._set_busy, config=cfg)

    def _publish_event(self, event: JobEvent) -> None:
        self.link.publish(self._events_topic, event.to_msgpack(self._sign_event), qos=1)
        # An unsigned JSON copy for JSON tools; the signed msgpack event above is the one the coordinator acts on.
        if self._progress_json.allow(event):
            self.link.publish(self._events_json_topic, event_json(event), qos=1)

    def _set_busy(self, busy: bool) -> None:
        self.link.publish(self.status_topic, self._status("busy" if busy else "online"), qos=1, retain=True)

    def _status(self, state: str, reason: str = "") -> bytes:
        activity = self.jobs.progress().activity if state == "busy" else ""
        return BoardStatus(state=state, ts=round(time.time(), 3), reason=reason, agent_version=__version__,
                           interval_s=self.cfg.telemetry.interval_s, keepalive_s=self.cfg.broker.keepalive_s,
                           activity=activity).to_json()

    def _complete(self, sample: TelemetrySample) -> TelemetrySample:
        """The sensors' sample with what the agent itself knows: the energy total and the running training job's steps."""
        progress = self.jobs.progress()
        return dataclasses.replace(sample, energy_wh=self.energy.add(sample.power_w), job_steps_done=progress.steps_done,
                                   job_total_steps=progress.total_steps)

    def _announce(self, link: MqttLink) -> None:
        # Runs after every (re)connect, so the retained status and the subscription are renewed.
        # Subscribed first: the broker handles one connection's packets in order, so a coordinator
        # that has seen this status reaches the board with any command it sends after it.
        prefix = self.cfg.broker.topic_prefix
        link.subscribe(cmd_topic(prefix, self.cfg.board_id), qos=1)
        link.publish(self.status_topic, self._status("busy" if self.jobs.busy else "online"), qos=1, retain=True)
        link.subscribe(self.status_topic, qos=1)  # after our status: a forged "offline" is answered (_on_own_status)
        self._update_address(link.local_address())
        link.publish(caps_topic(prefix, self.cfg.board_id), self.caps.to_json(), qos=1, retain=True)
        if self.discovery is not None:  # retained: Home Assistant finds the board whenever it starts
            for topic, payload in self.discovery.configs():
                link.publish(topic, payload, qos=1, retain=True)

    def _update_address(self, connection_local: str) -> None:
        """Put where other boards reach this one into the caps: the config's, else ``connection_local``, the broker
        connection's local address, known only once the connection exists (renewed on every reconnect: a new lease
        may change it)."""
        configured = self.cfg.training.address
        address = reachable_address(configured, connection_local)
        if address == self.caps.address:
            return
        self.caps = dataclasses.replace(self.caps, address=address)
        if configured:
            log.info("board %s: other boards reach it at %s ([training] address)", self.cfg.board_id, address)
        elif address.startswith("127.") or address == "::1":
            log.info("board %s: other boards reach it at %s, the local end of its broker connection, which only this "
                     "machine can reach; set [training] address if boards elsewhere train pipeline stages with it",
                     self.cfg.board_id, address)
        else:
            log.info("board %s: other boards reach it at %s (the local end of its broker connection; [training] "
                     "address overrides it)", self.cfg.board_id, address or "an unknown address")

    def _on_message(self, topic: str, payload: bytes, retained: bool) -> None:
        if topic == self.status_topic:
            self._on_own_status(payload, retained)
        else:
            self._on_command(topic, payload, retained)

    def _on_own_status(self, payload: bytes, retained: bool) -> None:
        """Answer an ``offline`` status on this board's topic while it runs with its real status, at once: a
        coordinator counts an offline status only once it stood unanswered (``control.board_channel``), so a
        forged one cannot end a job. Only ``offline`` is answered: two agents with one id never echo each other."""
        if retained or self._stopping or not payload:  # a retained one is what we found; ours at stop is real
            return
        try:
            state = BoardStatus.from_json(payload).state
        except DecodeError:
            return
        if state == "offline":
            shown = self._forged_status_log.allow()
            if shown is not None:
                log.warning("an offline status for this board was published while it runs (by someone else: forged, or "
                            "an old connection's last will): answered with its real status%s", suppressed_text(shown))
            self.link.publish(self.status_topic, self._status("busy" if self.jobs.busy else "online"), qos=1, retain=True)

    def _on_command(self, topic: str, payload: bytes, retained: bool) -> None:
        if retained:  # a command is for now; a retained one is left over or planted
            log.warning("refused a retained command on %s (commands are never retained)", topic)
            return
        self.jobs.handle(payload)

    def run(self, stop: threading.Event) -> int:
        interval = self.cfg.telemetry.interval_s
        log.info("board %s: publishing every %.3g s to %s (prefix %s)", self.cfg.board_id, interval,
                 self.cfg.broker.address(), self.cfg.broker.topic_prefix)
        self.link.start()
        # Ready once sampling works, broker or not: a board whose broker is down stays up and retries.
        sd_notify("READY=1", f"STATUS=board {self.cfg.board_id}, broker {self.cfg.broker.address()}")
        next_t = time.monotonic()
        try:
            while not stop.is_set():
                sample = self._complete(self.sampler.read())
                new_configs = self.discovery.observe(sample) if self.discovery is not None else []
                if self.link.connected.is_set():
                    for topic, payload in new_configs:  # a field that just got its first value
                        self.link.publish(topic, payload, qos=1, retain=True)
                    self.link.publish(self.telemetry_topic, sample.to_json(), qos=0)
                sd_notify("WATCHDOG=1")
                next_t += interval
                now = time.monotonic()
                if next_t < now:  # fell behind (suspend, a slow sensor): skip, don't burst
                    next_t = now + interval
                stop.wait(next_t - now)
        finally:
            sd_notify("STOPPING=1")
            self._stopping = True
            self.jobs.stop()
            self.link.close(final=[(self.status_topic, self._status("offline", "stopped"))], timeout_s=1.0)
            self.sampler.close()
            self.energy.save()
            log.info("board %s: stopped", self.cfg.board_id)
        return ExitCode.OK


def disk_folders(cfg: AgentConfig) -> dict[str, Path]:
    """The folders whose disks telemetry reports: the state_dir ("data", if set) and the working directory ("run"),
    where the training worker runs and writes (systemd's unit sets it to the state directory)."""
    folders = {"run": Path(os.getcwd())}
    if cfg.state_dir:
        folders["data"] = Path(cfg.state_dir)
    return folders


def run(cfg: AgentConfig) -> int:
    """Run until SIGTERM or SIGINT; returns the exit code."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return Agent(cfg).run(stop)
