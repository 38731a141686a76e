"""The router's model list: where models come from and the arguments each one is served with.

Sources, as llama-server's router reads them (``common/preset.cpp: load_from_models_dir``,
``common/download.cpp: common_list_cached_models``, ``tools/server/README.md`` "Model presets"):

- ``$LLAMA_CACHE``, the hub cache ``-hf`` fills: each GGUF model there is named ``user/repo:TAG``.
- ``--models-dir DIR``: each ``*.gguf`` file is a model named after the file (``.gguf`` dropped;
  ``mmproj*`` and draft files, ``mtp-``/``dspark-``/``dflash-``, are companions, not models); each
  subdirectory is a model named after the directory: its first split part
  (``…-00001-of-0000N.gguf``) or its GGUF file, or, beyond llama-server, a Hugging Face / MLX model
  directory (one with a ``config.json``). A split GGUF lying in DIR itself is one model named
  without its ``-00001-of-0000N`` suffix (llama-server lists each part).
- ``--models-preset FILE.ini``: a section per model, keys are flags without their dashes (long or
  short) or their ``LLAMA_ARG_*`` variables; ``[*]`` holds defaults for every model. A section
  named like a model of the directory sets that model's arguments; any other section must say
  ``model = PATH`` (or ``hf-repo = user/repo[:quant]``). Keys only presets have:
  ``load-on-startup``, ``stop-timeout``, ``pin`` (this server's: never evicted) and ``alias``.

A model's arguments are the preset's ``[*]``, then its own section, then the router's command line
(highest), less what the router owns (the listener, the model sources, the model itself).
"""

from __future__ import annotations

import configparser
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from mlxcel_compat.settings import SETTINGS, Setting, parse_argv, parse_bool

DRAFT_PREFIXES = ("mtp-", "dspark-", "dflash-")
FIRST_SPLIT = re.compile(r"^(?P<stem>.+)-00001-of-\d{5}\.gguf$")
ANY_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
# Keys a preset section may hold that are not command-line arguments.
PRESET_ONLY = ("load-on-startup", "stop-timeout", "pin", "dedup-cache-models", "version")
# Settings the router decides for every model: not passed on from its command line or a preset.
ROUTER_OWNED = frozenset({
    "host", "port", "model", "hf_repo", "hf_file", "alias", "models_dir", "models_preset", "models_max",
    "models_autoload", "models_memory", "help", "version",
})
DEFAULT_STOP_TIMEOUT = 10.0  # seconds a requested unload waits for running requests (llama-server's)


class SourceError(ValueError):
    """A model source that cannot be read (missing directory, malformed preset); stops start-up."""


@dataclass
class ModelSource:
    """One model the router knows: its name, what to load and the arguments to serve it with."""

    name: str
    model: str  # a path, or a hub repository (``hf-repo`` in a preset)
    source: str  # "models_dir" or "preset"
    options: dict[str, str] = field(default_factory=dict)  # the preset's keys (``[*]`` merged in)
    aliases: list[str] = field(default_factory=list)
    pin: bool = False
    load_on_startup: bool = False
    stop_timeout: float = DEFAULT_STOP_TIMEOUT
    hidden: bool = False  # a cache entry a preset's ``dedup-cache-models`` leaves out of /models


def _is_companion(name: str) -> bool:
    return "mmproj" in name or name.startswith(DRAFT_PREFIXES)


def _model_in_subdir(directory: Path) -> str | None:
    """A subdirectory's model: a model directory (config.json), its first split part, or its GGUF."""
    if (directory / "config.json").is_file():
        return str(directory)
    gguf = sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(".gguf") and not _is_companion(p.name))
    first = [p for p in gguf if FIRST_SPLIT.match(p.name)]
    if first:
        return str(first[0])
    whole = [p for p in gguf if not ANY_SPLIT.search(p.name)]
    return str(whole[0]) if whole else None


def scan_models_dir(root: str) -> list[ModelSource]:
    """The models of ``--models-dir``, sorted by name."""
    base = Path(root).expanduser()
    if not base.is_dir():
        raise SourceError(f"--models-dir '{root}' does not exist or is not a directory")
    found: list[ModelSource] = []
    for entry in sorted(base.iterdir()):
        if entry.is_dir():
            model = _model_in_subdir(entry)
            if model is not None:
                found.append(ModelSource(entry.name, model, "models_dir"))
        elif entry.name.endswith(".gguf") and not _is_companion(entry.name):
            split = FIRST_SPLIT.match(entry.name)
            if split:
                found.append(ModelSource(split["stem"], str(entry), "models_dir"))
            elif not ANY_SPLIT.search(entry.name):
                found.append(ModelSource(entry.name[: -len(".gguf")], str(entry), "models_dir"))
    return found


SPLIT_PART = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})$", re.IGNORECASE)
QUANT_TAG = re.compile(r"[-.](?P<tag>[A-Z0-9_]+)$", re.IGNORECASE)
CACHE_COMPANIONS = ("mmproj", "mtp-", "eagle3-", "dflash-", "dspark-")


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot ``refs/main`` points at (the only one when there is no ref)."""
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        path = repo_dir / "snapshots" / ref.read_text().strip()
        return path if path.is_dir() else None
    snapshots = sorted(p for p in (repo_dir / "snapshots").iterdir() if p.is_dir())
    return snapshots[0] if len(snapshots) == 1 else None


def scan_hub_cache(cache_dir: str) -> list[ModelSource]:
    """The GGUF models of a Hugging Face hub cache (``$LLAMA_CACHE`` as ``-hf`` fills it), named
    as llama-server names them: ``user/repo:TAG``, the tag being the quantization suffix of the
    file (its first part for a split model); companion files (mmproj, drafts) are left out."""
    root = Path(cache_dir).expanduser()
    if not root.is_dir():
        return []
    found: dict[str, ModelSource] = {}
    for repo_dir in sorted(root.glob("models--*--*")):
        repo = repo_dir.name[len("models--"):].replace("--", "/")
        snapshot = _snapshot(repo_dir) if (repo_dir / "snapshots").is_dir() else None
        if snapshot is None or repo.count("/") != 1:
            continue
        for file in sorted(p for p in snapshot.rglob("*.gguf")):
            prefix = file.name[: -len(".gguf")]
            split = SPLIT_PART.match(prefix)
            if split:
                if int(split["index"]) != 1:
                    continue
                prefix = split["prefix"]
            tag = QUANT_TAG.search(prefix)
            if tag is None or any(c in prefix for c in CACHE_COMPANIONS):
                continue
            name = f"{repo}:{tag['tag'].upper()}"
            found.setdefault(name, ModelSource(name, str(file), "cache"))
    return list(found.values())


def read_preset(path: str) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``(defaults, sections)`` of an INI preset file; keys keep their case (variable names)."""
    parser = configparser.ConfigParser(interpolation=None, strict=False, comment_prefixes=(";", "#"),
                                       inline_comment_prefixes=None, default_section="\0none")
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    try:
        with open(Path(path).expanduser(), encoding="utf-8") as f:
            # Keys before the first section (llama-server's "version = 1") belong to no model.
            parser.read_string("[\0top]\n" + f.read(), source=path)
    except (OSError, configparser.Error) as exc:
        raise SourceError(f"cannot read --models-preset '{path}': {exc}") from exc
    sections = {name: dict(parser[name]) for name in parser.sections() if name != "\0top"}
    defaults = sections.pop("*", {})
    return defaults, sections


def _preset_flag(key: str) -> str:
    return key.strip().lstrip("-")


def _option_bool(options: dict[str, str], key: str, where: str) -> bool:
    try:
        return parse_bool(options[key]) if key in options else False
    except ValueError:
        raise SourceError(f"preset [{where}]: {key} = {options[key]!r} is not a boolean") from None


def _model_keys(options: dict[str, str]) -> tuple[str | None, dict[str, str]]:
    """A section's model (``model``/``m``/``hf-repo``/``hf`` or their variables) and its other keys."""
    keys = {_preset_flag(k): v for k, v in options.items()}
    model = None
    for name in ("model", "m", "LLAMA_ARG_MODEL", "hf-repo", "hf", "hfr", "LLAMA_ARG_HF_REPO"):
        value = keys.pop(name, None)
        model = model or value
    return model, keys


def collect_sources(models_dir: str | None, preset: str | None, cache_dir: str | None = None) -> list[ModelSource]:
    """Every model the router serves, from the hub cache, the directory and the preset (names
    unique; a directory's model hides a cached one of the same name, a preset section sets either)."""
    models = {m.name: m for m in (scan_hub_cache(cache_dir) if cache_dir else [])}
    models.update({m.name: m for m in (scan_models_dir(models_dir) if models_dir else [])})
    defaults, sections = read_preset(preset) if preset else ({}, {})
    _, common = _model_keys(defaults)
    own: dict[str, dict[str, str]] = {}
    for name, options in sections.items():
        target, own[name] = _model_keys(options)
        if target:
            source = models[name].source if name in models else "preset"
            models[name] = ModelSource(name, target, source)
        elif name not in models:
            raise SourceError(f"preset [{name}] names no model of --models-dir: give it 'model = PATH' or 'hf-repo = user/repo'")
    backing: set[str] = set()  # hub repositories ([:TAG]) that dedup-cache-models presets stand for
    for name, entry in models.items():
        merged = {**common, **own.get(name, {})}
        if entry.source == "preset" and _option_bool(merged, "dedup-cache-models", name):
            drafts = [merged.get(k) for k in ("spec-draft-hf", "hfd", "hfrd", "hf-repo-draft")]
            for value in (v for v in [entry.model, *drafts] if v):
                repo, _, tag = value.partition(":")
                backing.add(f"{repo}:{tag.upper()}" if tag else repo)
        entry.pin = _option_bool(merged, "pin", name)
        entry.load_on_startup = _option_bool(merged, "load-on-startup", name)
        try:
            entry.stop_timeout = float(merged.get("stop-timeout", DEFAULT_STOP_TIMEOUT))
        except ValueError:
            raise SourceError(f"preset [{name}]: stop-timeout = {merged['stop-timeout']!r} is not a number") from None
        aliases = merged.pop("alias", None) or merged.pop("a", None) or merged.pop("LLAMA_ARG_ALIAS", None)
        entry.aliases = [a.strip() for a in (aliases or "").split(",") if a.strip()]
        entry.options = {k: v for k, v in merged.items() if k not in PRESET_ONLY}
    for entry in models.values():
        entry.hidden = entry.source == "cache" and (entry.name in backing or entry.name.split(":")[0] in backing)
    _check_names(models.values())
    return sorted(models.values(), key=lambda m: m.name)


def _check_names(models: Iterable[ModelSource]) -> None:
    """llama-server's rule: a name or alias names one model only."""
    owner: dict[str, str] = {}
    for model in models:
        for label in [model.name, *model.aliases]:
            if label in owner and owner[label] != model.name:
                raise SourceError(f"alias '{label}' of model '{model.name}' conflicts with model '{owner[label]}'")
            owner[label] = model.name


# --------------------------------------------------------------------------- arguments


def _index() -> dict[str, tuple[Setting, bool]]:
    """Every spelling a preset key may use (a flag without dashes, or a variable) -> (setting, negative)."""
    index: dict[str, tuple[Setting, bool]] = {}
    for setting in SETTINGS:
        for flag in setting.flags:
            index.setdefault(flag.lstrip("-"), (setting, False))
        for flag in setting.negative_flags:
            index.setdefault(flag.lstrip("-"), (setting, True))
        for name in setting.env:
            index.setdefault(name, (setting, False))
        if setting.mlxcel_env:
            index.setdefault(setting.mlxcel_env, (setting, False))
    return index


KEY_INDEX = _index()


def preset_tokens(options: dict[str, str], where: str) -> list[str]:
    """A preset section's keys as command-line tokens (``c = 4096`` -> ``-c=4096``)."""
    tokens: list[str] = []
    for key, value in options.items():
        hit = KEY_INDEX.get(key)
        if hit is None:
            raise SourceError(f"preset [{where}]: unknown key '{key}'")
        setting, negative = hit
        if setting.name in ROUTER_OWNED:
            continue
        flag = setting.flags[0] if setting.flags else None
        if flag is None:
            raise SourceError(f"preset [{where}]: '{key}' has no command-line flag")
        if setting.type == "bool" and setting.arity == "flag":
            try:
                on = parse_bool(value) != negative
            except ValueError:
                raise SourceError(f"preset [{where}]: {key} = {value!r} is not a boolean") from None
            tokens.append(f"{flag}={'true' if on else 'false'}")
        elif setting.arity == "pair":
            tokens += [flag, *value.split(None, 1)]
        else:
            tokens.append(f"{flag}={value}")
    return tokens


def command_tokens(argv: list[str]) -> list[str]:
    """The router's command line less what the router owns, to pass on to every model."""
    tokens: list[str] = []
    for name, occurrences in parse_argv(argv).items():
        if name in ROUTER_OWNED:
            continue
        for occ in occurrences:
            value: Any = occ.value
            if isinstance(value, bool):
                tokens.append(occ.spelling)
            elif isinstance(value, tuple):
                tokens += [occ.spelling, *value]
            else:
                tokens.append(f"{occ.spelling}={value}")
    return tokens


def model_argv(source: ModelSource, router_argv: list[str]) -> list[str]:
    """The arguments ``source`` is served with: preset (``[*]`` then its section), then the
    router's command line, then the model and its name (the router's)."""
    return [*preset_tokens(source.options, source.name), *command_tokens(router_argv),
            "--model", source.model, "--alias", source.name]


__all__ = ["ModelSource", "SourceError", "collect_sources", "model_argv", "read_preset", "scan_hub_cache", "scan_models_dir"]
