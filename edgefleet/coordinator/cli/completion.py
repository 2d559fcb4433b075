"""``edge-coordinator completion bash|zsh``: tab completion for ``edge-coordinator`` and ``edge-agent``.

The script is generated from the argparse parsers themselves, so a new command or flag completes
without anyone editing a shell file, and nothing new is installed (argcomplete would be a
dependency and a hook in every start-up). zsh runs the same bash function through ``bashcompinit``.

``--boards ID,ID,…`` completes the board ids the last ``status`` saw (:func:`remember_boards` keeps
them in ``$XDG_CACHE_HOME/edgefleet/boards``, else ``~/.cache/edgefleet/boards``), after each comma too.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SHELLS = ("bash", "zsh")
_WORD = re.compile(r"^[A-Za-z0-9_.:/@+,=%-]+$")  # what may stand unquoted in a compgen word list
_PATH_METAVARS = ("FILE", "DIR", "PATH", "RUN_DIR", "FOLDER")
BOARD_CACHE_SHELL = '"${XDG_CACHE_HOME:-$HOME/.cache}/edgefleet/boards"'  # board_cache_path() as the shell finds it
# the ids after the last comma of the word, each offered with what comes before it
_BOARD_OFFER = ('COMPREPLY=($(compgen -P "${cur%"${cur##*,}"}" -W "$(cat ' + BOARD_CACHE_SHELL
                + ' 2>/dev/null)" -- "${cur##*,}"))')


def board_cache_path() -> Path:
    """Where ``status`` leaves the board ids it saw, for completing ``--boards``."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "edgefleet" / "boards"


def remember_boards(board_ids: Iterable[str]) -> None:
    """Keep ``board_ids`` (those ``status`` just showed) for completing ``--boards``; a cache that cannot be
    written is skipped (logged at DEBUG): completion is a convenience."""
    ids = sorted({b for b in board_ids if _WORD.match(b) and "," not in b})
    path = board_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}")
        temp.write_text("".join(f"{b}\n" for b in ids))
        temp.replace(path)
    except OSError as exc:
        log.debug("cannot keep the board ids for completion in %s: %s", path, exc)


def add_completion_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    completion = sub.add_parser("completion", help="print a shell completion script for edge-coordinator and edge-agent",
                                description="Print a tab-completion script for edge-coordinator and edge-agent (commands, "
                                            "flags, and the values of flags with a fixed set of choices). Load it in the "
                                            "current shell with: source <(edge-coordinator completion bash); for every "
                                            "shell, save it as ~/.local/share/bash-completion/completions/edge-coordinator "
                                            "(bash) or put that source line in ~/.zshrc (zsh).")
    completion.add_argument("shell", choices=SHELLS, help="the shell to complete in")


def cmd_completion(args: argparse.Namespace, parsers: Sequence[argparse.ArgumentParser]) -> int:
    """``edge-coordinator completion``: prints the script for ``parsers`` (edge-coordinator's and
    edge-agent's, given by ``cli.main``, which owns the first) and returns 0."""
    print(completion_script(list(parsers), shell=args.shell), end="")
    return 0


@dataclass
class _Level:
    """One parser's completions: its flags, its positional choices and its sub-commands."""

    flags: list[str] = field(default_factory=list)
    value_flags: dict[str, str] = field(default_factory=dict)   # flag -> "choices ..." / "file" / "dir" / "boards" / "any"
    positional: list[str] = field(default_factory=list)          # words a positional argument can be
    positional_files: bool = False
    commands: dict[str, _Level] = field(default_factory=dict)


def _words(values: object) -> list[str]:
    return [str(v) for v in values if _WORD.match(str(v))] if isinstance(values, (list, tuple, dict, set, range)) else []


def _value_kind(action: argparse.Action) -> str:
    if action.choices is not None:
        return "choices " + " ".join(_words(list(action.choices)))
    metavar = str(action.metavar or "")
    if action.dest == "boards" and metavar.startswith("ID"):
        return "boards"
    if "DIR" in metavar or metavar == "FOLDER":
        return "dir"
    if any(word in metavar for word in _PATH_METAVARS) or getattr(action.type, "__name__", "") in ("Path", "PosixPath"):
        return "file"
    return "any"


def describe_parser(parser: argparse.ArgumentParser) -> _Level:
    """What ``parser`` completes, walking its sub-command parsers."""
    level = _Level()
    for action in parser._actions:  # argparse has no public walk of a parser's actions
        if action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                if _WORD.match(name):
                    level.commands[name] = describe_parser(child)
        elif action.option_strings:
            level.flags += action.option_strings
            if action.nargs != 0:
                for flag in action.option_strings:
                    level.value_flags[flag] = _value_kind(action)
        elif action.choices is not None:
            level.positional += _words(list(action.choices))
        elif _value_kind(action) in ("file", "dir"):
            level.positional_files = True
    return level


def _function_name(prog: str) -> str:
    return "_edgefleet_" + re.sub(r"[^A-Za-z0-9_]", "_", prog)


def _case_arms(path: str, level: _Level, levels: list[str], values: list[str]) -> None:
    """Shell ``case`` arms for the command path ``path`` (" train" etc.) and below: what each level
    offers (``levels``) and what the word after each of its valued flags can be (``values``)."""
    offers = {"dir": 'COMPREPLY=($(compgen -d -- "$cur"))', "file": 'COMPREPLY=($(compgen -f -- "$cur"))',
              "boards": _BOARD_OFFER, "any": ":"}  # any: a free value (a number, an address), nothing to offer
    for flag, kind in level.value_flags.items():
        offer = f'COMPREPLY=($(compgen -W "{kind[8:]}" -- "$cur"))' if kind.startswith("choices ") else offers[kind]
        values.append(f'        "{path}|{flag}") {offer}; return;;')
    words = " ".join([*level.commands, *level.positional])
    files = "1" if level.positional_files else ""
    levels.append(f'        "{path}") flags="{" ".join(level.flags)}"; words="{words}"; files="{files}";;')
    for name, child in level.commands.items():
        _case_arms(f"{path} {name}", child, levels, values)


def _commands_of(level: _Level, path: str = "") -> list[tuple[str, list[str]]]:
    """(command path, its sub-command names) for every level that has sub-commands."""
    found = [(path, list(level.commands))] if level.commands else []
    for name, child in level.commands.items():
        found += _commands_of(child, f"{path} {name}")
    return found


def bash_function(parser: argparse.ArgumentParser) -> str:
    """A bash completion function for ``parser``'s program, and the ``complete`` line that registers it."""
    level = describe_parser(parser)
    level_arms: list[str] = []
    value_arms: list[str] = []
    _case_arms("", level, level_arms, value_arms)
    descend = [f'        "{path}|{name}") path="{path} {name}";;' for path, names in _commands_of(level) for name in names]
    name = _function_name(parser.prog)
    lines = [
        f"{name}() {{",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="" path="" flags="" words="" files="" i',
        '    (( COMP_CWORD > 0 )) && prev="${COMP_WORDS[COMP_CWORD-1]}"',
        "    # Walk the words before the cursor: each sub-command name moves one level down.",
        '    for (( i = 1; i < COMP_CWORD; i++ )); do',
        '        case "$path|${COMP_WORDS[i]}" in',
        *descend,
        "        esac",
        "    done",
        "    # The word after a flag that takes a value: that flag's choices, a file, or nothing.",
        '    case "$path|$prev" in',
        *value_arms,
        "    esac",
        '    case "$path" in',
        *level_arms,
        "    esac",
        '    if [[ "$cur" == -* ]]; then',
        '        COMPREPLY=($(compgen -W "$flags" -- "$cur"))',
        "    else",
        '        COMPREPLY=($(compgen -W "$words" -- "$cur"))',
        '        [[ -n "$files" ]] && COMPREPLY+=($(compgen -f -- "$cur"))',
        "    fi",
        "}",
        f"complete -F {name} {parser.prog}",
    ]
    return "\n".join(lines) + "\n"


def completion_script(parsers: list[argparse.ArgumentParser], *, shell: str) -> str:
    """The completion script for ``parsers``' programs in ``shell`` ("bash" or "zsh")."""
    if shell not in SHELLS:
        raise ValueError(f"shell {shell!r} is not one of {SHELLS}")
    header = [f"# {shell} completion for {', '.join(p.prog for p in parsers)}, generated by 'edge-coordinator completion {shell}'."]
    if shell == "zsh":
        header.append("autoload -U +X bashcompinit && bashcompinit  # zsh runs the bash functions below")
    return "\n".join(header) + "\n" + "".join(bash_function(p) for p in parsers)


__all__ = ["SHELLS", "add_completion_parser", "bash_function", "board_cache_path", "cmd_completion", "completion_script",
           "describe_parser", "remember_boards"]
