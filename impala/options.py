"""The one configuration mechanism: typed, documented dataclasses -> command-line flags, validated once.

Every folder may import this module (it imports nothing of the project), so a network, an env wrapper or a
message can raise the same :class:`ConfigError` an entry point turns into one line and exit status 2.

- :func:`option` declares a field with its ``--help`` text.
- :func:`add_flags` turns a dataclass into flags (``bool`` -> ``--x/--no-x``, ``Literal`` ->
  choices, ``Optional`` -> also accepts ``none``); :func:`from_flags` builds it back.
- :class:`FlagParser` reports every bad flag in one line (``prog: error: ...``, exit 2); ``--help`` shows
  each option's first sentence, ``--help-all`` its whole text.
- :func:`check_fields` checks every field's type, finiteness and choices; each dataclass's
  ``__post_init__`` adds its ranges with :func:`need`. :class:`ConfigError` messages name the flag and say
  how to fix it.
- :func:`load_preset` reads a YAML preset (a file, or one shipped in ``impala/configs`` by name) strictly
  (:func:`read_yaml`); :func:`apply_preset` layers it under the flags given.

The configurations themselves are its users: ``impala.run.config`` (``RunConfig``, ``ImpalaConfig``),
``impala.run.ppo_config`` (``PPOConfig``), ``impala.evaluation`` (``EvalConfig``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import os
import re
import sys
import types
import typing
from dataclasses import field
from typing import Any, Iterable, Literal, Mapping, Union


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says how to fix it."""


# --------------------------------------------------------------------------- the flags helper


def option(default: Any, help: str, *, brief: str = "") -> Any:
    """A dataclass field with its help: ``help`` the whole text (``--help-all``, the docs), ``brief`` its one
    line in ``--help`` (unset: the text's first sentence). Both written here, once, beside the default."""
    return field(default=default, metadata={"help": help, "brief": brief})


def flag_name(name: str) -> str:
    """A field name as its flag: ``learning_rate`` -> ``--learning-rate``."""
    return "--" + name.replace("_", "-")


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints`` once per class: it compiles every (string) annotation of the class on
    each call, and asked once per field it was most of a parser's build and a config's check."""
    return typing.get_type_hints(cls)


def field_kind(cls: type, name: str) -> tuple[tuple[Any, ...] | None, type, bool]:
    """(Literal choices or None, base type, whether None is allowed) of a dataclass field."""
    tp = _type_hints(cls)[name]
    optional = False
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        optional = type(None) in args
        tp = [a for a in args if a is not type(None)][0]
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        return choices, type(choices[0]), optional
    return None, tp, optional


def check_fields(obj: Any, *, label: Any = flag_name) -> None:
    """Type, finiteness and choices of every field; inf or nan in a float option trains a NaN
    network or never stops, and no option means that. ``label(name)`` starts each message."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        choices, base, optional = field_kind(type(obj), f.name)
        name = label(f.name)
        if value is None:
            if optional:
                continue
            raise ConfigError(f"{name} must be set")
        if choices is not None:
            if value not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
        elif base is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be true or false, got {value!r}")
        elif base is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        elif base is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        elif base is str and not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")


def need(cond: bool, msg: str) -> None:
    """ConfigError(``msg``) unless ``cond``: how every config check reads."""
    if not cond:
        raise ConfigError(msg)


_NOT_GIVEN = object()  # an action's default while FlagParser finds out which flags were given
_ACCUMULATING = (
    argparse._AppendAction,
    argparse._AppendConstAction,
    argparse._ExtendAction,
    argparse._CountAction,
)


HELP_WIDTH = 110  # columns of --help, whatever the terminal: one layout everywhere (docs quote it)
# A sentence ends at a period, semicolon or colon before a capital letter, a flag or a quote: "e.g. x" and
# "0.5" do not end one.
SENTENCE_END = re.compile(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.;])\s+(?=[A-Z'\"`-])")


def first_sentence(text: str) -> str:
    """What ``--help`` shows of an option's description: its first sentence."""
    head = SENTENCE_END.split(" ".join(text.split()), maxsplit=1)[0]
    return head if head.endswith((".", ")")) or not head else head.rstrip(";") + "."


class BriefHelpFormatter(argparse.HelpFormatter):
    """``--help``: a one-line usage, each option with the first sentence of its description and its default
    as used (none when unset: the description says what unset means); ``--help-all`` has the rest."""

    brief = True

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=HELP_WIDTH)

    def _format_usage(self, usage: Any, actions: Any, groups: Any, prefix: Any) -> str:
        return f"usage: {self._prog} [options]   (--help-all: every option in full)\n\n"

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not self.brief or not action.option_strings:
            return super()._format_action_invocation(action)
        if isinstance(action, argparse.BooleanOptionalAction):
            return ", ".join(f"--[no-]{o[2:]}" for o in action.option_strings if not o.startswith("--no-"))
        if action.nargs == 0:
            return ", ".join(action.option_strings)
        return f"{', '.join(action.option_strings)} {self._metavar(action)}"

    def _metavar(self, action: argparse.Action) -> str:
        # a choice's values go first in its line, not into the option column
        return "CHOICE" if action.choices else self._metavar_formatter(action, action.dest.upper())(1)[0]

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if self.brief and text:
            text = getattr(action, "brief", None) or first_sentence(text)
            if action.choices and action.option_strings and self._metavar(action) == "CHOICE":
                text = f"{'|'.join(str(c) for c in action.choices if c is not None)}: {text}"
        default = action.default
        shown = (
            action.option_strings
            and "%(default)" not in text
            and default not in (None, "", argparse.SUPPRESS)
            and not isinstance(action, (argparse._HelpAction, _FullHelp))
        )
        if shown:
            if isinstance(action, argparse.BooleanOptionalAction):
                text += f" [default: {'on' if default else 'off'}]"
            elif action.nargs != 0:
                text += " [default: %(default)s]"
        return text


class FullHelpFormatter(BriefHelpFormatter):
    """``--help-all``: every option's whole description."""

    brief = False

    def _format_usage(self, usage: Any, actions: Any, groups: Any, prefix: Any) -> str:
        return argparse.HelpFormatter._format_usage(self, usage, actions, groups, prefix)


class _FullHelp(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        parser._print_message(parser.format_full_help(), sys.stdout)
        parser.exit()


class FlagParser(argparse.ArgumentParser):
    """argparse with one-line errors (``prog: error: ...``, exit 2), each default shown once, and
    ``args.given``: the destinations set on the command line. That set is the one way any entry point
    tells "given" from "default" (presets yield to given flags; a default may depend on another option).
    """

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", BriefHelpFormatter)
        # A typo must never pick another flag (--total-frame for --total-frames, --lr for --lr-decay).
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)
        self.add_argument(
            "--help-all",
            action=_FullHelp,
            nargs=0,
            help="Every option with its whole description, then exit.",
        )

    def format_full_help(self) -> str:
        """``--help-all``: every option with its whole text (``--help`` gives each its first sentence)."""
        saved, self.formatter_class = self.formatter_class, FullHelpFormatter
        try:
            return self.format_help()
        finally:
            self.formatter_class = saved

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            flags = [a for a in message.split(":", 1)[1].split() if a.startswith("--")]
            known = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
            hints = [
                f"{flag.split('=')[0]} -> {close[0]}"
                for flag in flags
                for close in [difflib.get_close_matches(flag.split("=")[0], known, n=1, cutoff=0.75)]
                if close
            ]
            if hints:
                message += f" (did you mean: {', '.join(hints)}?)"
        self.exit(2, f"{self.prog}: error: {capped(message)}\n")

    def parse_known_args(
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        parsed.given = self._given(args)
        return parsed, extras

    def _given(self, args: Any) -> set[str]:
        # Parse again with every default swapped for a sentinel: what is not the sentinel afterwards was
        # given.
        # Actions that build on their current value (append, extend, count) start from None instead.
        saved = [
            (action, action.default) for action in self._actions if action.default is not argparse.SUPPRESS
        ]
        accumulating = {a.dest for a, _ in saved if isinstance(a, _ACCUMULATING)}
        saved_defaults, self._defaults = self._defaults, {}
        try:
            for action, _ in saved:
                action.default = None if action.dest in accumulating else _NOT_GIVEN
            probe, _ = super().parse_known_args(args, argparse.Namespace())
        finally:
            for action, default in saved:
                action.default = default
            self._defaults = saved_defaults
        return {
            dest
            for dest, value in vars(probe).items()
            if value is not _NOT_GIVEN and not (dest in accumulating and value is None)
        }


def _parse_none_or(kind: type):
    def parse(text: str):
        if text.strip().lower() in ("none", "null"):
            return None
        return kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def add_flags(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    *,
    dest_prefix: str = "",
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
    helps: dict[str, str] | None = None,
    aliases: dict[str, Iterable[str]] | None = None,
    briefs: dict[str, str] | None = None,
    names: dict[str, str] | None = None,
) -> None:
    """One ``--flag`` per field of ``cls`` (``only`` / ``skip`` select fields); ``aliases`` gives a field
    more flag names (``{"device": ["--torch-device"]}``), each setting the same destination; ``names``
    gives a field another main flag (``{"beta": "--entropy-cost"}``: one vocabulary across the launchers,
    the field's own name then an alias). ``briefs``: an entry point's own one line for ``--help`` in place of
    the field's (``--help-all`` shows its whole text; without a brief, ``--help`` shows the text's first
    sentence).

    ``defaults`` and ``helps`` let an entry point give a shared field its own default or text (a default
    of ``argparse.SUPPRESS`` leaves no attribute when the flag is not given: for options whose default
    depends on another one and is said in the help text). Which flags were given: ``args.given``
    (:class:`FlagParser`).
    """
    keep = set(only) if only is not None else None
    defaults, helps, aliases = defaults or {}, helps or {}, aliases or {}
    briefs, names = briefs or {}, names or {}
    for f in dataclasses.fields(cls):
        if f.name in skip or (keep is not None and f.name not in keep):
            continue
        choices, base, optional = field_kind(cls, f.name)
        default = defaults.get(f.name, f.default)
        kw: dict[str, Any] = {
            "dest": dest_prefix + f.name,
            "default": default,
            "help": helps.get(f.name, f.metadata.get("help", "")),
        }
        # short metavars keep --help's option column narrow: N a count, X a number, TEXT the rest
        kw["metavar"] = {int: "N", float: "X"}.get(base, "TEXT")
        if base is bool and choices is None:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _parse_none_or(base) if optional else base
            if choices is not None:
                kw["choices"] = list(choices) + ([None] if optional else [])
                kw["metavar"] = "{" + ",".join(map(str, choices)) + "}"
        main = names.get(f.name, flag_name(f.name))
        others = [flag_name(f.name)] if main != flag_name(f.name) else []
        action = parser.add_argument(main, *others, *aliases.get(f.name, ()), **kw)
        brief = briefs.get(f.name) or f.metadata.get("brief")
        if brief:
            action.brief = brief


def from_flags(cls: type, args: argparse.Namespace, *, dest_prefix: str = "", **extra: Any) -> Any:
    """Build ``cls`` from parsed flags (fields without a flag keep their defaults)."""
    ns = vars(args)
    kwargs = {f.name: ns[dest_prefix + f.name] for f in dataclasses.fields(cls) if dest_prefix + f.name in ns}
    kwargs.update(extra)
    return cls(**kwargs)


def given_flags(cls: type, args: argparse.Namespace, *, dest_prefix: str = "") -> dict[str, Any]:
    """The fields of ``cls`` set on the command line (``args.given``, :class:`FlagParser`) or by a preset
    (``args.preset``, :func:`apply_preset`)."""
    chosen = getattr(args, "given", set()) | getattr(
        args, "preset", set()
    )  # by a flag, or by a --config preset
    return {
        f.name: getattr(args, dest_prefix + f.name)
        for f in dataclasses.fields(cls)
        if dest_prefix + f.name in chosen
    }


# Options that say one thing in two units: a flag given for either replaces a preset's value of the other (a
# preset's budget in frames yields to --total-steps on the command line, as any flag overrides a preset).
ONE_SETTING_IN_TWO_UNITS = (("total_frames", "total_steps"),)


def apply_preset(args: argparse.Namespace, preset: dict[str, Any]) -> argparse.Namespace:
    """Defaults < preset (:func:`load_preset`) < flags given on the command line; ``args.preset`` names the
    options the preset set. ``args.preset_replaced``: (the preset's option, its value, the flag given for
    the same setting in another unit) for each preset value such a flag replaced, for the launcher to say."""
    args.preset_replaced = []
    for pair in ONE_SETTING_IN_TWO_UNITS:
        for name, other in (pair, pair[::-1]):
            if other in args.given and name not in args.given and preset.get(name) is not None:
                args.preset_replaced.append((name, preset[name], f"--{other.replace('_', '-')}"))
    replaced = {name for name, _, _ in args.preset_replaced}
    preset = {k: v for k, v in preset.items() if k not in replaced}
    for name, value in preset.items():
        if name not in args.given:
            setattr(args, name, value)
    args.preset = set(preset)
    return args


def say_preset_replaced(args: argparse.Namespace, log: Any) -> None:
    """One line for each preset value a flag in another unit replaced (:func:`apply_preset`)."""
    for name, value, flag in getattr(args, "preset_replaced", ()):
        log.info("%s %s replaces the preset's %s %s", flag, getattr(args, name_of(flag)), name, value)


def name_of(flag: str) -> str:
    """``--total-steps`` -> ``total_steps``."""
    return flag.lstrip("-").replace("-", "_")


# The presets shipped inside the package (the repository's configs/ links here): found by bare name too.
PRESETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def preset_file(path: str, what: str = "--config") -> str:
    """``path`` if it is a file; else a preset shipped with the package by that name (``atari`` or
    ``atari.yaml`` -> impala/configs/atari.yaml), so ``--config atari`` works from any directory. Neither is
    a :class:`ConfigError` listing the presets; a missing path whose file name is a preset's
    (``configs/atari.yaml`` outside the repository) is one naming the preset."""
    base = os.path.basename(path)
    name = base if base.endswith((".yaml", ".yml")) else f"{base}.yaml"
    shipped = os.path.join(PRESETS_DIR, name)
    if os.path.exists(path):
        return path
    if os.sep in path:
        if os.path.isfile(shipped):  # a repository path (configs/atari.yaml) used outside the clone
            raise ConfigError(
                f"{what} {path}: no such file; the preset of that name ships with the package: "
                f"{what} {os.path.splitext(name)[0]}"
            )
        return path
    if os.path.isfile(shipped):
        return shipped
    names = (
        sorted(f[:-5] for f in os.listdir(PRESETS_DIR) if f.endswith(".yaml"))
        if os.path.isdir(PRESETS_DIR)
        else []
    )
    raise ConfigError(
        f"{what} {path}: no such file, and no preset of that name (presets: {', '.join(names)})"
    )


def load_preset(path: str, classes: Iterable[type]) -> dict[str, Any]:
    """Read a preset file (or a shipped preset by name, :func:`preset_file`): a YAML mapping from option names
    to values, for the fields of ``classes``.

    Keys are the long flags without dashes (``learning_rate`` or ``learning-rate``). An unknown
    key or a value of the wrong type is a :class:`ConfigError` naming the file and the key. The
    values become the parser's defaults, so explicit flags still override them.
    """
    doc = read_yaml(preset_file(path), "--config")
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option: value, got {type(doc).__name__}")
    return option_values(doc, classes, f"--config {path}")


def option_values(
    doc: Mapping[Any, Any], classes: Iterable[type], what: str, *, unknown: str = "refuse"
) -> dict[str, Any]:
    """The option values of a mapping read from a file (a preset, a run's config.yaml), each checked
    against its field's type and choices: a wrong one is a :class:`ConfigError` naming ``what`` and the
    key. ``unknown``: 'refuse' a key that is no field of ``classes`` (one line naming it), or 'skip' it."""
    owner = {f.name: cls for cls in classes for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in doc.items():
        name = str(key).replace("-", "_")
        if name not in owner:
            if unknown == "skip":
                continue
            close = difflib.get_close_matches(name, list(owner), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"{what}: unknown option {key!r}{hint}")
        choices, typ, optional = field_kind(owner[name], name)
        if unknown == "skip" and typ not in (bool, int, float, str):
            continue  # a setting with no flag (a list a file gave), not a user's option
        if typ is float and isinstance(value, str):
            # PyYAML (YAML 1.1) reads 1e-3 (no dot) as a string; take it as the number it reads as.
            try:
                value = float(value)
            except ValueError:
                pass
        ok = (
            optional
            if value is None  # null for an optional field: unset
            else value in choices
            if choices is not None
            else isinstance(value, bool)
            if typ is bool
            else isinstance(value, int) and not isinstance(value, bool)
            if typ is int
            else isinstance(value, (int, float)) and not isinstance(value, bool)
            if typ is float
            else isinstance(value, str)
        )
        if not ok:
            want = "one of " + ", ".join(map(str, choices)) if choices is not None else typ.__name__
            raise ConfigError(f"{what}: {key} must be {want}, got {capped(repr(value), 80)}")
        values[name] = float(value) if typ is float and value is not None else value
    return values


MAX_ERROR_CHARS = 600  # a value echoed in an error line is cut here: an error must stay one readable line


def capped(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` on one line, cut to ``limit`` characters (a bad value can be megabytes long)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def fail(prog: str, error: BaseException | str) -> int:
    """One line on stderr, exit status 2: how every entry point reports bad input."""
    text = str(error).strip() or type(error).__name__
    print(f"{prog}: error: {capped(text)}", file=sys.stderr)
    return 2


MAX_YAML_BYTES = 1 << 20  # presets and trainer configs are a few KB
MAX_YAML_DEPTH = 32  # nesting levels; ML-Agents' deepest trainer config has 5


def read_yaml(path: str, what: str) -> Any:
    """A small YAML config file, read strictly: a duplicated key, an anchor or alias (a few hundred bytes of
    aliases can expand to gigabytes), nesting deeper than ``MAX_YAML_DEPTH``, a file over ``MAX_YAML_BYTES``
    or one that is not text is a :class:`ConfigError` naming ``what`` (the flag) and the file."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent) or getattr(self.peek_event(), "anchor", None):
                mark = self.peek_event().start_mark
                raise ConfigError(
                    f"{what} {path}: line {mark.line + 1}: YAML anchors and aliases are not accepted in a "
                    "config file"
                )
            self._depth = getattr(self, "_depth", 0) + 1
            try:
                if self._depth > MAX_YAML_DEPTH:
                    raise ConfigError(f"{what} {path}: nested deeper than {MAX_YAML_DEPTH} levels")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise ConfigError(
                        f"{what} {path}: key {capped(repr(key), 80)} appears twice (lines {seen[key]} and "
                        f"{line})"
                    )
                if isinstance(key, (str, int, float, bool)):
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    try:
        if os.path.getsize(path) > MAX_YAML_BYTES:
            raise ConfigError(f"{what} {path}: larger than {MAX_YAML_BYTES // 1024} KiB; not a config file")
        with open(path, "rb") as fh:
            text = fh.read().decode("utf-8")
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ConfigError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path}: is a directory, not a YAML file") from None
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path}: not a text file (expected YAML)") from None
    except RecursionError:
        raise ConfigError(f"{what} {path}: nested too deeply") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path}: not valid YAML ({capped(str(e).splitlines()[0], 200)})") from None
