"""The one settings table: CLI flags, env vars, defaults, ``--help`` and docs/configuration.md.

mlxcel_compat is a drop-in replacement for llama-server, so a deployment must be able to keep its
command line and its ``LLAMA_ARG_*`` environment unchanged. Every option is declared once in
``SETTINGS``; the CLI parser, the environment lookup, the ``--help`` text, the generated
``docs/configuration.md`` and the flag part of ``docs/compat/llama-server.json`` all come from it.

Resolution (``resolve_settings``), highest priority first:

1. a command-line flag;
2. ``MLXCEL_<NAME>`` (derived from the attribute name, never written by hand);
3. the llama.cpp alias variables of the setting (``LLAMA_ARG_*``, ``LLAMA_API_KEY``, ``HF_TOKEN``, ...);
4. the default (``None`` defaults are filled in later from the model, e.g. cache capacities).

Each llama-server option has a status: ``supported``; ``noop`` (accepted with the right arity so the
command line still parses, then listed in ``Settings.ignored`` for the caller to log); or ``refused``
(start-up fails with a ``SettingsError`` that says why).

The command line is parsed by a small loop rather than by argparse because llama.cpp's rules
differ from argparse's: a flag that takes a value takes the next argument verbatim even when it
starts with ``-`` (``-r -User:``), names are never abbreviated, short options never combine, and
``--long_name`` means ``--long-name``. ``build_parser()`` still gives an argparse view of the same
table (used for ``--help``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from mlxcel_compat.listen import parse_hosts

TYPES = ("str", "int", "float", "bool", "list", "json", "choice")
STATUSES = ("supported", "noop", "refused")
ARITIES = ("flag", "value", "optional", "pair")
GROUPS: tuple[tuple[str, str], ...] = (
    ("server", "Server and HTTP"),
    ("limits", "Request limits"),
    ("model", "Model and chat"),
    ("sampling", "Sampling defaults"),
    ("cache", "Prompt cache"),
    ("speculative", "Speculative decoding"),
    ("logging", "Logging"),
    ("compat", "llama.cpp options without an MLX equivalent"),
)

# llama.cpp's truthy/falsey words (common_arg_utils::is_truthy / is_falsey) plus yes/no, any case.
TRUE_WORDS = ("on", "enabled", "true", "1", "yes")
FALSE_WORDS = ("off", "disabled", "false", "0", "no")
BOOL_ACCEPTS = "one of " + ", ".join(TRUE_WORDS + FALSE_WORDS) + " (any case)"
MLXCEL_ENV_PREFIX = "MLXCEL_"

DEFAULT_SAMPLERS = "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature"
DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")


class SettingsError(ValueError):
    """A configuration mistake found at start-up; the message names the flag or variable."""


@dataclass(frozen=True)
class Setting:
    """One option: how it is spelled on the CLI and in the environment, its type and default.

    ``arity`` says how many argv items a flag consumes: ``flag`` (none; bools also accept an
    inline ``--flag=BOOL``), ``value`` (one), ``optional`` (``--flag``, ``--flag=V`` or
    ``--flag V`` when V does not look like another flag) or ``pair`` (two). It defaults to
    ``flag`` for bools and ``value`` otherwise.
    """

    name: str
    flags: tuple[str, ...] = ()
    env: tuple[str, ...] = ()  # llama.cpp alias variables; MLXCEL_<NAME> is derived
    type: str = "str"
    default: Any = None
    help: str = ""
    status: str = "supported"
    negative_flags: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    group: str = "server"
    reason: str = ""  # why a noop/refused option does nothing; a compatibility note otherwise
    arity: str = ""
    metavar: str = ""
    minimum: float | None = None
    maximum: float | None = None
    separator: str | None = ","  # list items per value; None = one item per flag occurrence
    list_reset: str = ""  # a list value that clears the items before it (llama.cpp's "none")
    escapes: bool = False  # process \n, \t, ... in user values while --escape is on
    parse: Callable[[str], Any] | None = None  # replaces the type's parser; raises ValueError
    accepts: str = ""  # what ``parse`` accepts, for error messages
    secret: bool = False  # never shown in repr()
    cli_only: bool = False  # no environment variable at all (--help, --version)
    upstream: bool = True  # False for options llama-server does not have
    default_doc: str = ""  # how docs show the default when it is computed later

    def __post_init__(self) -> None:
        if not self.arity:
            object.__setattr__(self, "arity", "flag" if self.type == "bool" else "value")

    @property
    def mlxcel_env(self) -> str | None:
        """The derived ``MLXCEL_<NAME>`` variable (``None`` for CLI-only settings)."""
        return None if self.cli_only else MLXCEL_ENV_PREFIX + self.name.upper()

    @property
    def negative_env(self) -> tuple[str, ...]:
        """``LLAMA_ARG_NO_<X>`` names: when one exists (any value) a negatable option is off."""
        if not self.negative_flags:
            return ()
        return tuple(n.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1) for n in self.env if n.startswith("LLAMA_ARG_"))

    @property
    def env_lookup(self) -> tuple[str, ...]:
        """Every variable read for this setting, in priority order."""
        names: list[str] = []
        if self.mlxcel_env:
            names.append(self.mlxcel_env)
        for alias in self.env:
            negative = alias.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)
            if negative in self.negative_env:
                names.append(negative)
            names.append(alias)
        return tuple(names)

    @property
    def takes_value(self) -> bool:
        return self.arity != "flag"


# --------------------------------------------------------------------------- value parsers


def parse_bool(raw: str) -> bool:
    """llama.cpp's words plus yes/no, case-insensitive; anything else is a ValueError."""
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(raw)


def _parse_int(raw: str) -> int:
    return int(raw.strip(), 10)


def _parse_float(raw: str) -> float:
    value = float(raw.strip())
    if math.isnan(value):
        raise ValueError(raw)
    return value


def _parse_json_object(raw: str) -> dict[str, Any]:
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _parse_tristate(raw: str) -> str:
    """on/off/auto, also accepting llama.cpp's truthy/falsey words and -1 for auto."""
    word = raw.strip().lower()
    if word in ("auto", "-1"):
        return "auto"
    return "on" if parse_bool(word) else "off"


def _parse_spec_types(raw: str) -> str:
    """``--spec-type``: llama-server's names, checked here so a typo stops start-up."""
    from mlxcel_compat.engine.speculative import parse_types

    return ",".join(parse_types(raw))


def _parse_n_parallel(raw: str) -> int:
    value = _parse_int(raw)
    if value == 0 or value < -1:
        raise ValueError(raw)
    return value


def _parse_hosts(raw: str) -> str:
    """``--host``: llama-server's comma-separated addresses (mlxcel_compat/listen.py), kept as given."""
    parse_hosts(raw)
    return raw


def _parse_positive_float(raw: str) -> float:
    value = _parse_float(raw)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(raw)
    return value


def _parse_json_file(raw: str) -> str:
    """A file holding a JSON object (read and checked at start-up; kept as the path)."""
    try:
        with open(os.path.expanduser(raw), encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(str(exc)) from None
    _parse_json_object(text)
    return raw


def _parse_directory(raw: str) -> str:
    """A directory, or a path where one can be made (kept as given; the server creates it at
    start-up, as it does ``--prompt-cache-dir``). An existing file is refused."""
    if not raw or (os.path.exists(os.path.expanduser(raw)) and not os.path.isdir(os.path.expanduser(raw))):
        raise ValueError(raw)
    return raw


def _parse_existing_directory(raw: str) -> str:
    """A directory that exists now (``--path``: llama-server stops start-up without it); empty: none."""
    if raw and not os.path.isdir(os.path.expanduser(raw)):
        raise ValueError(raw)
    return raw


def _parse_readable_file(raw: str) -> str:
    """A file this process can read now (kept as given): the TLS key and certificate; empty: none."""
    path = os.path.expanduser(raw)
    if raw and (not os.path.isfile(path) or not os.access(path, os.R_OK)):
        raise ValueError(raw)
    return raw


def _parse_threads(raw: str) -> int:
    """llama.cpp's thread counts: N >= 1, or 0 / a negative number for every CPU (kept as -1)."""
    value = _parse_int(raw)
    return value if value > 0 else -1


def _parse_cache_reuse(raw: str) -> int:
    """llama.cpp's chunk size (an integer >= 0); a true/false word counts as 1/0."""
    text = raw.strip()
    try:
        value = int(text, 10)
    except ValueError:
        return 1 if parse_bool(text) else 0
    if value < 0:
        raise ValueError(raw)
    return value


_TYPE_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": _parse_int,
    "float": _parse_float,
    "bool": parse_bool,
    "json": _parse_json_object,
}
_TYPE_ACCEPTS = {
    "int": "an integer",
    "float": "a number",
    "bool": BOOL_ACCEPTS,
    "json": "a JSON object",
    "str": "a string",
    "list": "a list of strings",
}


def _accepts(setting: Setting) -> str:
    if setting.accepts:
        return setting.accepts
    if setting.type == "choice":
        return "one of " + ", ".join(setting.choices)
    return _TYPE_ACCEPTS[setting.type]


# --------------------------------------------------------------------------- table helpers


def _noop(
    name: str,
    flags: tuple[str, ...],
    help: str,
    reason: str,
    *,
    metavar: str = "",
    env: tuple[str, ...] = (),
    negative_flags: tuple[str, ...] = (),
    group: str = "compat",
    type: str = "",
    arity: str = "",
) -> Setting:
    """An accepted-and-ignored llama.cpp option; a ``metavar`` means it takes a value."""
    kind = type or ("str" if metavar else "bool")
    return Setting(
        name=name, flags=flags, env=env, type=kind, default=None, help=help, status="noop",
        negative_flags=negative_flags, group=group, reason=reason, arity=arity, metavar=metavar,
        separator=None,
    )


def _refused(
    name: str,
    flags: tuple[str, ...],
    help: str,
    reason: str,
    *,
    metavar: str = "",
    env: tuple[str, ...] = (),
    negative_flags: tuple[str, ...] = (),
    group: str = "compat",
    type: str = "",
) -> Setting:
    """A llama.cpp option whose use stops start-up (bools only when they resolve to true)."""
    kind = type or ("str" if metavar else "bool")
    return Setting(
        name=name, flags=flags, env=env, type=kind, default=() if kind == "list" else None, help=help,
        status="refused", negative_flags=negative_flags, group=group, reason=reason, metavar=metavar,
    )


R_THREADS = ("thread placement is left to the OS: -t and -tb bound the CPU runtime's thread counts; affinity, "
             "priority, polling and NUMA placement are not set")
R_DEVICE = "MLX runs the whole model on its default device (Metal, CUDA or CPU); there is no layer offload"
R_LOADING = ("a GGUF's quantized weights are served from the file's blocks on the CPU and float weights from MLX "
             "arrays; llama.cpp's buffer, device and placement options have nothing to place")
R_FIT = "no automatic memory fitting; set --ctx-size and the --prompt-cache-* budgets instead"
# -ctk/-ctv: llama-server's names this server stores KV in (runtime/kv_precision.py: DTYPES).
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
KV_CACHE_TYPES_ACCEPT = ("one of f32, f16, bf16, q8_0, q4_0 (llama-server's q4_1, iq4_nl, q5_0 and q5_1 are not "
                         "implemented)")
R_ROPE = ("mlx-lm's YaRN RoPE has no such parameter (it mixes extrapolation fully and takes its attention "
          "factor from the model's mscale); --rope-scaling, --rope-scale, --rope-freq-* and --yarn-orig-ctx/beta-* apply")
R_SPEC = "the draft model runs on the engine thread beside the model, with its settings"
R_SPEC_NGRAM = ("that n-gram drafting kind is not served here (--spec-type refuses it); ngram-simple, ngram-mod "
                "and ngram-cache are")
R_SPEC_REMOVED = ("removed from llama-server (it refuses the option now); accepted and ignored for older "
                  "deployments: use --spec-draft-n-max, --spec-draft-n-min, --spec-ngram-simple-size-n/m")
R_MMPROJ = ("the projector (--mmproj) runs with the model on MLX's default device, one request's images at a time; "
            "llama.cpp's placement and batching options for it have nothing to act on")
R_SLOTS = "mlxcel_compat keeps a radix prompt cache instead of llama.cpp's slot caches; see --prompt-cache-*"
R_LORA_ENV = "llama-server reads no environment variable for it (MLXCEL_* only)"
R_CVEC = "control vectors are not supported"
R_TOOLS_RUNTIME = ("the built-in tools run on the host only; llama-server's container (docker:, podman:) and "
                   "ssh: runtimes are not implemented, so leave --tools-runtime unset")
R_MCP = "stdio servers only, as llama-server b11312; one JSON message per line"
R_GGUF = "models are loaded from a local path (-m) or a Hugging Face repository (-hf)"
R_COMMAND = "this llama.cpp command is not available in mlxcel_compat"
R_TEMPLATE_KW = "set it per request or through --chat-template-kwargs"


# --------------------------------------------------------------------------- the table

_SERVER: tuple[Setting, ...] = (
    Setting("help", ("-h", "--help", "--usage"), type="bool", default=False, cli_only=True,
            help="Print this help and exit."),
    Setting("version", ("--version",), type="bool", default=False, cli_only=True,
            help="Print the version and exit."),
    Setting("host", ("--host",), ("LLAMA_ARG_HOST",), default="127.0.0.1", metavar="HOST",
            parse=_parse_hosts, accepts="a comma-separated list of at least one address",
            help="Addresses to listen on, comma-separated, each an IP address, a host name or a UNIX socket "
                 "path ending in .sock; all share --port. With several TCP addresses IPv6 ones are "
                 "IPv6-only (0.0.0.0,:: binds both families) and --port 0 is refused."),
    Setting("port", ("--port",), ("LLAMA_ARG_PORT",), type="int", default=8080, minimum=0, maximum=65535,
            metavar="PORT", help="Port to listen on (0 = any free port)."),
    Setting("api_prefix", ("--api-prefix",), ("LLAMA_ARG_API_PREFIX",), default="", metavar="PREFIX",
            help="Serve every route under this path prefix (no trailing slash)."),
    Setting("api_key", ("--api-key",), ("LLAMA_API_KEY",), type="list", default=(), secret=True, metavar="KEY",
            help="API key(s), comma-separated; the flag may repeat. Clients send one as 'Authorization: "
                 "Bearer KEY' or 'X-Api-Key: KEY'."),
    Setting("api_key_file", ("--api-key-file",), ("LLAMA_ARG_API_KEY_FILE",), metavar="FNAME",
            help="File with one API key per line (blank lines and # comments skipped), added to --api-key."),
    Setting("timeout", ("-to", "--timeout"), ("LLAMA_ARG_TIMEOUT",), type="int", default=3600, minimum=0,
            help="HTTP read/write timeout in seconds."),
    Setting("n_parallel", ("-np", "--parallel"), ("LLAMA_ARG_N_PARALLEL",), type="int", default=-1,
            parse=_parse_n_parallel, accepts="-1 (auto) or an integer >= 1",
            help="Slots: sequences decoded at the same time (-1 = auto = 4 with --kv-unified; 0 is rejected). "
                 "Each slot gets ctx-size / parallel tokens of context unless --kv-unified is on."),
    Setting("cont_batching", ("-cb", "--cont-batching"), ("LLAMA_ARG_CONT_BATCHING",), type="bool", default=True,
            negative_flags=("-nocb", "--no-cont-batching"),
            help="Continuous batching: admit new requests while others are decoding."),
    Setting("sse_ping_interval", ("--sse-ping-interval",), ("LLAMA_ARG_SSE_PING_INTERVAL",), type="int",
            default=30, minimum=-1, help="Seconds of silence before an SSE keep-alive comment (-1 = never)."),
    Setting("stream_buffer_bytes", ("--stream-buffer-bytes",), type="int", default=4 * 1024 * 1024, minimum=1024,
            upstream=False, metavar="BYTES",
            help="Bytes each resumable stream (X-Conversation-Id) keeps for a reader that reconnects; "
                 "older bytes are dropped first (llama-server's fixed 4 MiB)."),
    Setting("metrics", ("--metrics",), ("LLAMA_ARG_ENDPOINT_METRICS",), type="bool", default=False,
            help="Enable the Prometheus /metrics endpoint."),
    Setting("slots", ("--slots",), ("LLAMA_ARG_ENDPOINT_SLOTS",), type="bool", default=True,
            negative_flags=("--no-slots",), help="Expose GET /slots."),
    Setting("props", ("--props",), ("LLAMA_ARG_ENDPOINT_PROPS",), type="bool", default=False,
            help="Allow POST /props (accepted and ignored, as in llama-server)."),
    Setting("cors_origins", ("--cors-origins",), ("LLAMA_ARG_CORS_ORIGINS",), default="*", metavar="ORIGINS",
            reason="as llama-server, except that a comma list echoes the request's Origin when it is listed "
                   "(llama-server sends the whole list, which browsers reject)",
            help="Allowed CORS origins, comma-separated; 'localhost' echoes only local origins."),
    Setting("cors_methods", ("--cors-methods",), ("LLAMA_ARG_CORS_METHODS",), default="GET, POST, DELETE, OPTIONS",
            metavar="METHODS", help="Allowed CORS methods, comma-separated."),
    Setting("cors_headers", ("--cors-headers",), ("LLAMA_ARG_CORS_HEADERS",), default="*", metavar="HEADERS",
            reason="sent as configured, '*' by default, whatever the preflight asks for, as llama-server",
            help="Allowed CORS headers, comma-separated."),
    Setting("cors_credentials", ("--cors-credentials",), ("LLAMA_ARG_CORS_CREDENTIALS",), type="bool",
            default=True, negative_flags=("--no-cors-credentials",),
            help="Allow credentials; with origins '*' the request's Origin is echoed."),
    Setting("threads_http", ("--threads-http",), ("LLAMA_ARG_THREADS_HTTP",), type="int", default=-1,
            parse=_parse_n_parallel, accepts="-1 (auto) or an integer >= 1", metavar="N",
            reason="connections are served by one event loop; these threads do the CPU work of requests",
            help="Worker threads that prepare requests off the event loop: parsing large bodies, rendering "
                 "chat templates, tokenizing, building large responses (-1 = auto = min(4, CPUs))."),
    Setting("shutdown_grace", ("--shutdown-grace",), type="float", default=5.0, minimum=0, upstream=False,
            metavar="SECONDS",
            help="After SIGTERM or SIGINT: seconds running requests may still finish while new ones get 503; "
                 "then they end with a final error event and the server exits. A second signal ends them at once."),
    Setting("reuse_port", ("--reuse-port",), ("LLAMA_ARG_REUSE_PORT",), type="bool", default=False,
            help="Set SO_REUSEPORT on the listening sockets, so that several servers may bind the same port "
                 "(the kernel spreads connections over them)."),
    Setting("static_path", ("--path",), ("LLAMA_ARG_STATIC_PATH",), default="", metavar="PATH",
            parse=_parse_existing_directory, accepts="an existing directory",
            help="Serve the static files of this directory at / in place of the built-in chat page, as "
                 "llama-server does: GET /FILE reads PATH/FILE (a directory's index.html for / and for "
                 "directory paths), API routes first; ignored with --no-ui."),
    Setting("ui", ("--ui", "--webui"), ("LLAMA_ARG_UI",), type="bool", default=True,
            negative_flags=("--no-ui", "--no-webui"), group="server",
            reason="the chat page is mlxcel_compat's own (static files in the package), not llama-server's Svelte UI",
            help="Serve the built-in chat page at / (off: /, /index.html and /ui/* answer 404)."),
    Setting("ui_config", ("--ui-config", "--webui-config"), ("LLAMA_ARG_UI_CONFIG",), type="json", default={},
            group="server", metavar="JSON",
            help="Default chat-page settings as a JSON object (llama-server's keys: systemMessage, temperature, "
                 "top_k, top_p, min_p, max_tokens, ..., custom); /props returns it as ui_settings. Settings saved "
                 "in the browser win. Overrides --ui-config-file."),
    Setting("ui_config_file", ("--ui-config-file", "--webui-config-file"), ("LLAMA_ARG_UI_CONFIG_FILE",),
            group="server", metavar="PATH", parse=_parse_json_file, accepts="a readable file holding a JSON object",
            help="File with default chat-page settings (a JSON object, as --ui-config)."),
    Setting("sleep_idle_seconds", ("--sleep-idle-seconds",), type="int", default=-1, minimum=-1, group="server",
            metavar="SECONDS",
            help="Unload the model after this many seconds without requests and return its memory; the next "
                 "generation reloads it (-1 = never). /health, /metrics, GET /props and /models answer without "
                 "waking it (/props reports is_sleeping); /tokenize, /detokenize, /apply-template, token counting, "
                 "/slots and /lora-adapters wake it, as llama-server b11312's do. The /metrics throughput gauges "
                 "still cover the window since the previous scrape."),
    Setting("models_max", ("--models-max",), ("LLAMA_ARG_MODELS_MAX",), type="int", default=4, minimum=0,
            metavar="N", group="server",
            help="Router mode: the most models loaded at once; loading another unloads the least recently used "
                 "one that is not pinned and serves no request (0 = unlimited)."),
    Setting("models_autoload", ("--models-autoload",), ("LLAMA_ARG_MODELS_AUTOLOAD",), type="bool", default=True,
            negative_flags=("--no-models-autoload",), group="server",
            help="Router mode: load a model on the first request that names it (a request may say "
                 "?autoload=true|false); off, such a request gets 400 'model is not loaded'."),
    Setting("models_memory", ("--models-memory",), type="int", default=0, minimum=0, metavar="BYTES",
            group="server", upstream=False,
            help="Router mode: the most bytes of model files loaded at once (0 = no limit); loading another "
                 "unloads the least recently used models that are not pinned first."),
    _refused("tools_runtime", ("--tools-runtime",), "Where built-in tools run (docker:IMAGE, ssh:TARGET, ...).",
             R_TOOLS_RUNTIME, metavar="OPTION", env=("LLAMA_ARG_TOOLS_RUNTIME",), group="server"),
    Setting("ssl_key_file", ("--ssl-key-file",), ("LLAMA_ARG_SSL_KEY_FILE",), metavar="FNAME",
            parse=_parse_readable_file, accepts="a readable file",
            reason="one of the two files without the other stops start-up (llama-server then serves plain HTTP)",
            help="PEM private key: with --ssl-cert-file, every listener serves HTTPS (hypercorn's TLS)."),
    Setting("ssl_cert_file", ("--ssl-cert-file",), ("LLAMA_ARG_SSL_CERT_FILE",), metavar="FNAME",
            parse=_parse_readable_file, accepts="a readable file",
            help="PEM certificate (chain) for HTTPS; needs --ssl-key-file."),
    Setting("models_dir", ("--models-dir",), ("LLAMA_ARG_MODELS_DIR",), metavar="PATH", group="server",
            reason="beyond llama-server: a Hugging Face / MLX model directory (with config.json) is a model too, "
                   "and a split GGUF lying in the directory itself is one model",
            help="Router mode (no -m): serve the models of this directory, each GGUF file and each "
                 "subdirectory (split GGUF parts, or a model directory) named after itself; docs/router.md."),
    Setting("models_preset", ("--models-preset",), ("LLAMA_ARG_MODELS_PRESET",), metavar="PATH", group="server",
            reason="beyond llama-server: 'pin = true' keeps a model loaded (never evicted)",
            help="Router mode (no -m): an INI file with a section of arguments per model ([*]: defaults for "
                 "all), 'model = PATH' for models not in --models-dir; docs/router.md."),
    Setting("ui_mcp_proxy", ("--ui-mcp-proxy", "--webui-mcp-proxy"), ("LLAMA_ARG_UI_MCP_PROXY",), type="bool",
            default=False, negative_flags=("--no-ui-mcp-proxy", "--no-webui-mcp-proxy"), group="server",
            reason="forwarded header names go out in canonical casing (X-Custom): the ASGI server lowercases "
                   "incoming names, llama-server keeps the page's casing",
            help="Experimental, never in untrusted environments: serve /cors-proxy?url=..., which forwards "
                 "a request to any http(s) URL (for the MCP servers a browser UI talks to) with only the "
                 "X-Llama-Server-Proxy-Header-* headers it was given. /props reports cors_proxy_enabled."),
    Setting("tools", ("--tools",), ("LLAMA_ARG_TOOLS",), type="list", default=(), metavar="TOOL1,TOOL2,...",
            group="server",
            reason="host runtime only (see --tools-runtime); a timed-out command's whole process group is killed "
                   "(llama-server kills the shell only); outside git repositories listings walk names in sorted "
                   "order (llama-server: directory order); grep patterns are Python regular expressions",
            help="Experimental, never in untrusted environments: enable built-in agent tools for the chat page "
                 "('all', or some of read_file, file_glob_search, grep_search, exec_shell_command, write_file, "
                 "edit_file, get_info); GET /tools lists them, POST /tools runs one on this host as the server's "
                 "user. Unless --cors-origins is given, CORS origins become 'localhost'."),
    Setting("mcp_servers_config", ("--mcp-servers-config",), ("LLAMA_ARG_MCP_SERVERS_CONFIG",), metavar="PATH",
            group="server", reason=R_MCP,
            help="Experimental, never in untrusted environments: a JSON file of MCP servers in Cursor's format "
                 "({\"mcpServers\": {NAME: {\"command\", \"args\", \"env\", \"cwd\", \"timeout_ms\"}}}); their "
                 "tools join /tools as NAME_TOOL. Unless --cors-origins is given, CORS origins become 'localhost'."),
    Setting("mcp_servers_json", ("--mcp-servers-json",), ("LLAMA_ARG_MCP_SERVERS_JSON",), metavar="JSON",
            group="server", reason=R_MCP,
            help="Experimental: MCP servers as inline JSON, as --mcp-servers-config (both may be given)."),
    Setting("agent", ("-ag", "--agent"), ("LLAMA_ARG_AGENT",), type="bool", default=False,
            negative_flags=("-no-ag", "--no-agent"), group="server",
            help="Experimental, never in untrusted environments: --tools all and --ui-mcp-proxy together "
                 "(CORS origins become 'localhost' unless --cors-origins is given)."),
    Setting("embeddings", ("--embedding", "--embeddings"), ("LLAMA_ARG_EMBEDDINGS",), type="bool", default=False,
            group="server",
            help="Serve /embedding, /embeddings and /v1/embeddings (501 without it). Completions still work; "
                 "embedding requests never touch the prompt cache."),
    Setting("rerank", ("--rerank", "--reranking"), ("LLAMA_ARG_RERANKING",), type="bool", default=False,
            group="server",
            help="Serve /rerank, /reranking, /v1/rerank and /v1/reranking (501 without it): embeddings with "
                 "pooling rank, as llama-server sets them."),
    Setting("slot_save_path", ("--slot-save-path",), group="server", metavar="PATH",
            parse=_parse_directory, accepts="a directory (created if missing)",
            reason="llama.cpp reads no variable for it; MLXCEL_SLOT_SAVE_PATH works here",
            help="Directory for slot files (created if missing): enables POST /slots/{id}?action=save|restore|erase "
                 "(501 without it). "
                 "Files carry the model, chat template and version they belong to; restoring a file of "
                 "another one is refused."),
)

MIB = 1 << 20

_LIMITS: tuple[Setting, ...] = (
    Setting("max_body_bytes", ("--max-body-bytes",), type="int", minimum=1024, group="limits",
            upstream=False, metavar="BYTES", default_doc="max(1 MiB, 64 bytes x context size), plus one base64 image at --media-max-bytes on a vision model",
            reason="413 in llama.cpp's error shape; the refused body is drained (bounded lingering close), so httpx, "
                   "requests, the openai SDK and curl all read the 413",
            help="Largest request body. A larger one gets 413 as soon as its Content-Length, or the part read so "
                 "far, says so; it is never parsed. The rest of it is then read and dropped before the connection "
                 "closes (a lingering close, so clients that send the whole body before reading see the 413), up to "
                 "max(128 MiB, 8 x this limit) bytes and 10 s; a longer body is cut at once. "
                 "The default holds any prompt that fits the context, "
                 "as text or token ids, with room to spare; parsing a body holds the event loop for about 20 ms "
                 "per MiB of token ids, which is why it is not larger."),
    Setting("n_probs_max", ("--n-probs-max",), type="int", default=100, minimum=0, group="limits", upstream=False,
            metavar="N",
            help="Largest n_probs (the /v1/completions logprobs) a request may ask for; above it, 400. "
                 "OpenAI's top_logprobs is capped at 20 whatever this says."),
    Setting("n_predict_max", ("--n-predict-max",), type="int", default=-1, minimum=-1, group="limits",
            upstream=False, metavar="N",
            help="Largest n_predict (max_tokens): larger values, and -1, are lowered to it "
                 "(-1 = no cap but the context)."),
    Setting("max_prompts", ("--max-prompts",), type="int", default=64, minimum=1, group="limits", upstream=False,
            metavar="N", help="Most prompts in one /completion or /v1/completions request; more: 400."),
    Setting("media_max_images", ("--media-max-images",), type="int", default=16, minimum=0, group="limits",
            upstream=False, metavar="N",
            help="Most images in one request (a vision-language model); more: 400."),
    Setting("media_max_audio", ("--media-max-audio",), type="int", default=16, minimum=0, group="limits",
            upstream=False, metavar="N",
            help="Most audio clips in one request (a model with an audio tower); more: 400."),
    Setting("media_max_audio_seconds", ("--media-max-audio-seconds",), type="float", default=600.0, minimum=0.0,
            group="limits", upstream=False, metavar="SECONDS",
            help="Longest audio clip, read from its header before it is decoded; longer: 400. A model's own "
                 "clip length bounds it too (Gemma 3n: 30 s)."),
    Setting("media_max_pixels", ("--media-max-pixels",), type="int", default=4096 * 4096, minimum=1,
            group="limits", upstream=False, metavar="N",
            help="Largest image, in pixels (width x height), read from its header before it is decoded: "
                 "a larger one (or a decompression bomb) is refused with 400. The image processor then "
                 "resizes what it takes to the model's own pixel budget."),
    Setting("media_max_bytes", ("--media-max-bytes",), type="int", default=10 * 1024 * 1024, minimum=1,
            group="limits", upstream=False, metavar="BYTES",
            help="Largest encoded image (after base64 decoding, or downloaded); larger: 400. llama-server's "
                 "download limit is 10 MB."),
    Setting("media_fetch", ("--media-fetch",), type="bool", default=False, group="limits", upstream=False,
            negative_flags=("--no-media-fetch",),
            help="Download http(s) image URLs (llama-server's limits: --media-max-bytes, 10 s). Off by "
                 "default, since a server often must not reach out: such a URL is then a 400."),
    Setting("max_stop_strings", ("--max-stop-strings",), type="int", default=32, minimum=0, group="limits",
            upstream=False, metavar="N",
            help="Most entries in stop, and in dry_sequence_breakers; more: 400."),
    Setting("max_stop_chars", ("--max-stop-chars",), type="int", default=1024, minimum=1, group="limits",
            upstream=False, metavar="N",
            help="Longest stop string or DRY sequence breaker, in characters; longer: 400."),
    Setting("max_logit_bias", ("--max-logit-bias",), type="int", default=1024, minimum=0, group="limits",
            upstream=False, metavar="N", help="Most logit_bias entries in one request; more: 400."),
    Setting("max_samplers", ("--max-samplers",), type="int", default=32, minimum=1, group="limits",
            upstream=False, metavar="N",
            help="Longest samplers list (names, or characters of the string form); longer: 400."),
)

_MODEL: tuple[Setting, ...] = (
    Setting("model", ("-m", "--model"), ("LLAMA_ARG_MODEL",), group="model", metavar="PATH",
            help="Model to serve: a GGUF file (the first part of a split model), a local MLX model directory, "
                 "or a Hugging Face repo id."),
    Setting("hf_repo", ("-hf", "-hfr", "--hf-repo"), ("LLAMA_ARG_HF_REPO",), group="model",
            metavar="USER/MODEL[:QUANT]",
            help="Hugging Face repository to download and serve. GGUF repositories: QUANT picks the first file "
                 "whose name contains QUANT. or QUANT- (default Q4_K_M, then Q8_0, then the first GGUF); mmproj "
                 "and imatrix files are skipped and split files fetched whole. A repository without GGUF files "
                 "(MLX, safetensors) is downloaded as a model directory."),
    Setting("hf_file", ("-hff", "--hf-file"), ("LLAMA_ARG_HF_FILE",), group="model", metavar="FILE",
            help="The GGUF file of --hf-repo to use, overriding the QUANT tag."),
    Setting("hf_token", ("-hft", "--hf-token"), ("HF_TOKEN",), group="model", secret=True, metavar="TOKEN",
            help="Hugging Face access token for private or gated repositories."),
    Setting("offline", ("--offline",), ("LLAMA_ARG_OFFLINE",), type="bool", default=False, group="model",
            help="Use only the local Hugging Face cache; never download."),
    Setting("llama_cache", (), ("LLAMA_CACHE",), group="model", metavar="DIR",
            help="Directory of the model download cache (standard Hugging Face hub layout); default: the hub's "
                 "own cache ($HF_HUB_CACHE, ~/.cache/huggingface/hub)."),
    Setting("alias", ("-a", "--alias"), ("LLAMA_ARG_ALIAS",), type="list", default=(), group="model",
            metavar="NAME", help="Model name(s) shown by the API, comma-separated; the alphabetically first "
                                 "is the model id and a request's model field may name any of them."),
    Setting("ctx_size", ("-c", "--ctx-size"), ("LLAMA_ARG_CTX_SIZE",), type="int", default=0, minimum=0,
            group="model", help="Context size in tokens (0 = the model's own), padded to a multiple of 256 and "
                                "shared among the slots (see --parallel, --kv-unified)."),
    Setting("batch_size", ("-b", "--batch-size"), ("LLAMA_ARG_BATCH",), type="int", default=2048, minimum=1,
            group="model", help="Logical batch size: the prefill chunk is the smaller of this and --ubatch-size."),
    Setting("ubatch_size", ("-ub", "--ubatch-size"), ("LLAMA_ARG_UBATCH",), type="int", default=512, minimum=1,
            group="model", help="Physical batch size: prompt tokens computed per forward pass (the prefill "
                                "chunk is the smaller of this and --batch-size; 512 measured best on CPU, "
                                "docs/benchmarks/cpu.md)."),
    Setting("chat_template", ("--chat-template",), ("LLAMA_ARG_CHAT_TEMPLATE",), group="model",
            metavar="TEMPLATE", help="Chat template: a built-in name or Jinja source (default: the model's)."),
    Setting("chat_template_file", ("--chat-template-file",), ("LLAMA_ARG_CHAT_TEMPLATE_FILE",), group="model",
            metavar="FNAME", help="File holding the Jinja chat template."),
    Setting("chat_template_kwargs", ("--chat-template-kwargs",), ("LLAMA_ARG_CHAT_TEMPLATE_KWARGS",),
            type="json", default={}, group="model",
            help="Extra template variables as a JSON object, e.g. '{\"enable_thinking\": false}'; "
                 "a request's chat_template_kwargs is merged over it."),
    Setting("jinja", ("--jinja",), ("LLAMA_ARG_JINJA",), type="bool", default=True, group="model",
            negative_flags=("--no-jinja",),
            help="Render chats with the Jinja template engine (off = llama.cpp's legacy built-in templates)."),
    Setting("reasoning_format", ("--reasoning-format",), ("LLAMA_ARG_THINK",), type="choice",
            choices=("none", "auto", "deepseek", "deepseek-legacy"), default="deepseek", group="model",
            help="Where thinking text goes: none = left in content; deepseek/auto = message.reasoning_content; "
                 "deepseek-legacy = both."),
    Setting("reasoning", ("-rea", "--reasoning"), ("LLAMA_ARG_REASONING",), type="choice",
            choices=("on", "off", "auto"), default="auto", group="model", parse=_parse_tristate,
            accepts="one of on, off, auto (or a boolean word)",
            help="Thinking in chats: on/off sets the template's enable_thinking; auto leaves it to the template."),
    Setting("lenient_tool_calls", ("--lenient-tool-calls",), ("LLAMA_ARG_LENIENT_TOOL_CALLS",), type="bool",
            default=True, group="model", upstream=False, negative_flags=("--no-lenient-tool-calls",),
            help="When tools are offered and tool_choice is not none, an answer that is only a call object "
                 "written without the template's markers ({\"name\": ..., \"arguments\": {...}}, bare or in a "
                 "json code fence) is returned as the call, as Ollama does, if it names an offered tool and its "
                 "arguments validate against that tool's schema (docs/tool-calls.md). Beyond llama-server."),
    Setting("tags", ("--tags",), ("LLAMA_ARG_TAGS",), type="list", default=(), group="model", metavar="TAGS",
            help="Informational model tags, comma-separated; GET /models lists them (sorted)."),
    _noop("reasoning_effort", ("--reasoning-effort",), "Default reasoning_effort template variable.",
          R_TEMPLATE_KW, metavar="LEVEL", env=("LLAMA_ARG_REASONING_EFFORT",), group="model"),
    Setting("reasoning_budget", ("--reasoning-budget",), ("LLAMA_ARG_THINK_BUDGET",), type="int", default=-1,
            minimum=-1, group="model", metavar="N",
            help="Default reasoning_budget_tokens: tokens allowed in a <think> block before the end tag is "
                 "forced (-1 = unlimited, 0 = close it at once)."),
    Setting("reasoning_budget_message", ("--reasoning-budget-message",), ("LLAMA_ARG_THINK_BUDGET_MESSAGE",),
            default="", group="model", metavar="MESSAGE",
            help="Default reasoning_budget_message: text forced before the end tag when the budget runs out."),
    Setting("reasoning_preserve", ("--reasoning-preserve",), ("LLAMA_ARG_REASONING_PRESERVE",), type="bool",
            default=True, group="model", negative_flags=("--no-reasoning-preserve",),
            help="Keep reasoning in the whole chat history, not only after the last user turn: the template "
                 "variable preserve_reasoning (and preserve_thinking, clear_thinking, ... that it sets), as "
                 "llama-server; given, it wins over --chat-template-kwargs."),
    _noop("skip_chat_parsing", ("--skip-chat-parsing",), "Leave reasoning and tool calls in content.",
          "chat output is always parsed", env=("LLAMA_ARG_SKIP_CHAT_PARSING",),
          negative_flags=("--no-skip-chat-parsing",), group="model"),
    _noop("prefill_assistant", ("--prefill-assistant",), "Continue a trailing assistant message.",
          "a trailing assistant message is always continued (llama-server's default)",
          env=("LLAMA_ARG_PREFILL_ASSISTANT",), negative_flags=("--no-prefill-assistant",), group="model"),
    _refused("model_url", ("-mu", "--model-url"), "Download a GGUF model from a URL.", R_GGUF,
             metavar="URL", env=("LLAMA_ARG_MODEL_URL",), group="model"),
    _refused("docker_repo", ("-dr", "--docker-repo"), "Docker Hub model repository.", R_GGUF, metavar="REPO",
             env=("LLAMA_ARG_DOCKER_REPO",), group="model"),
    Setting("override_kv", ("--override-kv",), type="list", default=(), group="model", metavar="KEY=TYPE:VALUE,...",
            reason="llama-server reads no environment variable for it (MLXCEL_* only)",
            help="Override GGUF metadata before the model's config and tokenizer are read (types int, float, "
                 "bool, str; comma-separated, the flag may repeat), e.g. tokenizer.ggml.eos_token_id=int:2 or "
                 "tokenizer.ggml.add_bos_token=bool:false. GGUF models only (a directory's config.json is "
                 "edited instead)."),
    _refused("model_preset",
             ("--embd-gemma-default", "--fim-qwen-1.5b-default", "--fim-qwen-3b-default", "--fim-qwen-7b-default",
              "--fim-qwen-7b-spec", "--fim-qwen-14b-spec", "--fim-qwen-30b-default", "--gpt-oss-20b-default",
              "--gpt-oss-120b-default", "--vision-gemma-4b-default", "--vision-gemma-12b-default"),
             "llama.cpp presets that download a GGUF model.",
             "presets are not implemented; pass -m or -hf with the model they name", group="model"),
    Setting("lora", ("--lora",), type="list", default=(), group="model", metavar="FNAME", reason=R_LORA_ENV,
            help="LoRA adapter(s) at scale 1.0: a GGUF LoRA file (convert_lora_to_gguf.py) or an mlx-lm / PEFT "
                 "adapter directory; comma-separated, the flag may repeat. Served unfused; adapter ids follow "
                 "the command line (--lora and --lora-scaled together)."),
    Setting("lora_scaled", ("--lora-scaled",), type="list", default=(), group="model", metavar="FNAME:SCALE",
            reason=R_LORA_ENV, help="LoRA adapter(s) with their initial scales (FNAME:SCALE, comma-separated; "
                                    "the flag may repeat)."),
    Setting("lora_init_without_apply", ("--lora-init-without-apply",), type="bool", default=False, group="model",
            reason=R_LORA_ENV, help="Load the adapters at scale 0 (set scales later with POST /lora-adapters)."),
    _refused("control_vector", ("--control-vector",), "Control vector file(s).", R_CVEC, metavar="FNAME",
             group="model", type="list"),
    _refused("control_vector_scaled", ("--control-vector-scaled",), "Control vectors with scales.", R_CVEC,
             metavar="FNAME:SCALE", group="model", type="list"),
    _noop("control_vector_layer_range", ("--control-vector-layer-range",), "Layers for control vectors.",
          R_CVEC, metavar="START END", arity="pair", group="model"),
)

_SAMPLING: tuple[Setting, ...] = (
    Setting("spm_infill", ("--spm-infill",), type="bool", default=False, group="sampling",
            help="/infill puts the suffix before the prefix (Suffix/Prefix/Middle), as some models prefer."),
    Setting("n_predict", ("-n", "--predict", "--n-predict"), ("LLAMA_ARG_N_PREDICT",), type="int", default=-1,
            minimum=-1, group="sampling", help="Default maximum of new tokens per request (-1 = no limit)."),
    Setting("n_keep", ("--keep",), type="int", default=0, minimum=-1, group="sampling",
            help="Default n_keep: prompt tokens kept on a context shift (-1 = all)."),
    Setting("temp", ("--temp", "--temperature"), type="float", default=0.8, minimum=0, group="sampling",
            help="Temperature (<= 0 = greedy)."),
    Setting("top_k", ("--top-k",), ("LLAMA_ARG_TOP_K",), type="int", default=40, minimum=0, group="sampling",
            help="Top-k sampling (0 = off)."),
    Setting("top_p", ("--top-p",), type="float", default=0.95, group="sampling", help="Top-p sampling (1.0 = off)."),
    Setting("min_p", ("--min-p",), type="float", default=0.05, group="sampling", help="Min-p sampling (0.0 = off)."),
    Setting("typical_p", ("--typical", "--typical-p"), type="float", default=1.0, group="sampling",
            help="Locally typical sampling (1.0 = off)."),
    Setting("top_n_sigma", ("--top-nsigma", "--top-n-sigma"), type="float", default=-1.0, group="sampling",
            help="Top-n-sigma sampling (-1 = off)."),
    Setting("xtc_probability", ("--xtc-probability",), type="float", default=0.0, group="sampling",
            help="XTC probability (0.0 = off)."),
    Setting("xtc_threshold", ("--xtc-threshold",), type="float", default=0.1, group="sampling",
            help="XTC threshold."),
    Setting("repeat_last_n", ("--repeat-last-n",), type="int", default=64, minimum=0, group="sampling",
            help="Tokens considered by the repetition penalties (0 = off)."),
    Setting("repeat_penalty", ("--repeat-penalty",), type="float", default=1.0, group="sampling",
            parse=_parse_positive_float, accepts="a finite number > 0",
            help="Repetition penalty (1.0 = off)."),
    Setting("presence_penalty", ("--presence-penalty",), type="float", default=0.0, group="sampling",
            help="Presence penalty (0.0 = off)."),
    Setting("frequency_penalty", ("--frequency-penalty",), type="float", default=0.0, group="sampling",
            help="Frequency penalty (0.0 = off)."),
    Setting("dry_multiplier", ("--dry-multiplier",), type="float", default=0.0, group="sampling",
            help="DRY multiplier (0.0 = off)."),
    Setting("dry_base", ("--dry-base",), type="float", default=1.75, group="sampling", help="DRY base."),
    Setting("dry_allowed_length", ("--dry-allowed-length",), type="int", default=2, minimum=0, group="sampling",
            help="DRY allowed length."),
    Setting("dry_penalty_last_n", ("--dry-penalty-last-n",), type="int", default=-1, minimum=-1,
            group="sampling", help="Tokens scanned by DRY (0 = off, -1 = context size)."),
    Setting("dry_sequence_breaker", ("--dry-sequence-breaker",), type="list", default=DEFAULT_DRY_BREAKERS,
            separator=None, list_reset="none", escapes=True, group="sampling", metavar="STRING",
            help="A DRY sequence breaker; repeat the flag for more. Replaces the defaults; 'none' clears them."),
    Setting("dynatemp_range", ("--dynatemp-range",), type="float", default=0.0, group="sampling",
            help="Dynamic temperature range (0.0 = off)."),
    Setting("dynatemp_exp", ("--dynatemp-exp",), type="float", default=1.0, group="sampling",
            help="Dynamic temperature exponent."),
    Setting("samplers", ("--samplers",), default=DEFAULT_SAMPLERS, group="sampling", metavar="SAMPLERS",
            help="Sampler chain, names separated by ';'."),
    Setting("sampling_seq", ("--sampler-seq", "--sampling-seq"), group="sampling", metavar="SEQUENCE",
            help="Sampler chain as one character per sampler (llama.cpp's short form)."),
    Setting("seed", ("-s", "--seed"), type="int", default=-1, minimum=-1, maximum=0xFFFFFFFF, group="sampling",
            help="RNG seed (-1 = random)."),
    Setting("ignore_eos", ("--ignore-eos",), type="bool", default=False, group="sampling",
            help="Keep generating past end-of-generation tokens."),
    Setting("min_keep", ("--min-keep",), type="int", default=0, minimum=0, group="sampling", upstream=False,
            help="Minimum tokens every sampler keeps."),
    Setting("n_probs", ("--n-probs",), type="int", default=0, minimum=0, group="sampling", upstream=False,
            help="Default top-N probabilities reported per token."),
    Setting("reverse_prompt", ("-r", "--reverse-prompt"), type="list", default=(), separator=None, escapes=True,
            group="sampling", metavar="PROMPT",
            help="Default stop string; repeat the flag for more. Used when a request sends no stop."),
    Setting("special", ("-sp", "--special"), type="bool", default=False, group="sampling",
            help="Render special tokens in generated text."),
    Setting("escape", ("-e", "--escape"), type="bool", default=True, negative_flags=("--no-escape",),
            group="sampling", help="Turn \\n, \\t, \\', \\\", \\\\ and \\xNN in -r and --dry-sequence-breaker "
                                   "values into the characters they name."),
    Setting("mirostat", ("--mirostat",), type="int", default=0, minimum=0, maximum=2, group="sampling",
            help="Mirostat sampling: 0 = off, 1 = Mirostat, 2 = Mirostat 2.0 (replaces the --samplers chain: "
                 "temperature, then mirostat)."),
    Setting("mirostat_lr", ("--mirostat-lr",), type="float", default=0.1, group="sampling",
            help="Mirostat learning rate (eta)."),
    Setting("mirostat_ent", ("--mirostat-ent",), type="float", default=5.0, group="sampling",
            help="Mirostat target entropy (tau)."),
    Setting("adaptive_target", ("--adaptive-target",), type="float", default=-1.0, maximum=1.0, group="sampling",
            help="Adaptive-p: the probability the selected tokens should have on average (-1 = off). Acts when "
                 "adaptive_p is in the sampler chain (--samplers ...;adaptive_p), as its final draw."),
    Setting("adaptive_decay", ("--adaptive-decay",), type="float", default=0.9, minimum=0.0, maximum=0.99,
            group="sampling", help="Adaptive-p: decay of the moving average of selected probabilities "
                                   "(0 = the last token only, 0.99 = a long memory)."),
    _noop("logit_bias", ("-l", "--logit-bias"), "Server-wide logit bias (TOKEN_ID+BIAS).",
          "send logit_bias per request instead", metavar="TOKEN_ID(+/-)BIAS", group="sampling", type="list"),
    _noop("backend_sampling", ("-bs", "--backend-sampling"), "Sample on the compute backend.",
          "sampling always runs inside the engine", env=("LLAMA_ARG_BACKEND_SAMPLING",), group="sampling"),
    Setting("grammar", ("--grammar",), group="sampling", metavar="GRAMMAR",
            help="Server-wide GBNF grammar (or Lark) for requests that bring no constraint of their own."),
    Setting("grammar_file", ("--grammar-file",), group="sampling", metavar="FNAME",
            help="File holding the server-wide grammar."),
    Setting("json_schema", ("-j", "--json-schema"), group="sampling", metavar="SCHEMA",
            help="Server-wide JSON schema (e.g. '{}' for any JSON object) for requests that bring no constraint "
                 "of their own."),
    Setting("json_schema_file", ("-jf", "--json-schema-file"), group="sampling", metavar="FILE",
            help="File holding the server-wide JSON schema."),
)

_CACHE: tuple[Setting, ...] = (
    Setting("cache_prompt", ("--cache-prompt",), ("LLAMA_ARG_CACHE_PROMPT",), type="bool", default=True,
            negative_flags=("--no-cache-prompt",), group="cache",
            help="Default of the request field cache_prompt. --no-cache-prompt also turns the server-wide "
                 "prompt cache off unless --prompt-cache-enabled is given."),
    Setting("cache_reuse", ("--cache-reuse",), ("LLAMA_ARG_CACHE_REUSE",), type="int", default=0, group="cache",
            parse=_parse_cache_reuse, accepts="an integer >= 0 or " + BOOL_ACCEPTS,
            reason="KV-shift chunk reuse is not implemented; the value only switches the prompt cache",
            help="llama.cpp's chunk-reuse size. Here N > 0 (or a true word) turns the prompt cache on and 0 (or a "
                 "false word) turns it off, when neither --prompt-cache-enabled nor MLXCEL_PROMPT_CACHE_ENABLED "
                 "is set."),
    Setting("prompt_cache_enabled", ("--prompt-cache-enabled",), type="bool", default=True, arity="optional",
            group="cache", upstream=False, metavar="BOOL",
            help="Keep finished sequences' KV state and reuse it for requests with the same prefix."),
    Setting("prompt_cache_capacity_bytes", ("--prompt-cache-capacity-bytes",), type="int", minimum=0,
            group="cache", upstream=False, default_doc="model-aware, at least 2 GiB",
            help="Byte budget of the prompt cache."),
    Setting("prompt_cache_max_entries", ("--prompt-cache-max-entries",), type="int", default=1024, minimum=1,
            group="cache", upstream=False, help="Maximum number of cached entries."),
    Setting("prompt_cache_ttl", ("--prompt-cache-ttl",), type="int", default=3600, minimum=0, group="cache",
            upstream=False, metavar="SECONDS", help="Seconds an entry lives after its last use."),
    Setting("prompt_cache_min_prefix", ("--prompt-cache-min-prefix",), type="int", default=32, minimum=0,
            group="cache", upstream=False, help="Shortest match (in tokens) that counts as a hit."),
    Setting("prompt_cache_isolation", ("--prompt-cache-isolation",), type="choice",
            choices=("none", "api-key", "salt"), group="cache", upstream=False,
            default_doc="api-key with more than one API key, else none",
            help="Which requests may share prompt-cache entries: none = all; salt = only requests with the same "
                 "cache_salt (or none); api-key = only requests authenticated by the same API key (and the same "
                 "cache_salt). TTFT and cached_tokens reveal whether someone sent a prompt before."),
    Setting("prompt_cache_pin_max_entries", ("--prompt-cache-pin-max-entries",), type="int", default=64, minimum=0,
            group="cache", upstream=False,
            help="Explicit cache breakpoints (cache_control) kept pinned at once; 0 turns pinning off."),
    Setting("prompt_cache_pin_capacity_bytes", ("--prompt-cache-pin-capacity-bytes",), type="int", minimum=0,
            group="cache", upstream=False, default_doc="a quarter of the prompt-cache budget",
            help="Bytes the pinned breakpoints may hold; beyond it the oldest pins become ordinary entries."),
    Setting("prompt_cache_pin_max_ttl", ("--prompt-cache-pin-max-ttl",), type="int", default=3600, minimum=1,
            group="cache", upstream=False, metavar="SECONDS",
            help="Longest pin a breakpoint may ask for (cache_control ttl: 5m by default, 1h on request)."),
    Setting("apc_enabled", ("--apc-enabled",), ("APC_ENABLED",), type="bool", default=True, arity="optional",
            group="cache", upstream=False, metavar="BOOL",
            help="Automatic prefix caching: partial reuse of cached entries, verified by block-hash chains. "
                 "Needs the prompt cache; off automatically for recurrent, hybrid and sliding-window models."),
    Setting("apc_block_size", ("--apc-block-size",), ("APC_BLOCK_SIZE",), type="int", default=16, minimum=1,
            group="cache", upstream=False, help="APC block size in tokens."),
    Setting("apc_num_blocks", ("--apc-num-blocks",), ("APC_NUM_BLOCKS",), type="int", minimum=1, group="cache",
            upstream=False, default_doc="64 x --prompt-cache-max-entries",
            help="Maximum number of APC block hashes tracked over all entries; over it, the least recently "
                 "used entries lose their chains (whole-prefix reuse only)."),
    Setting("apc_hash", ("--apc-hash",), ("APC_HASH",), type="choice", choices=("sha256", "blake3"),
            default="sha256", group="cache", upstream=False, help="Hash function of the APC block chain."),
    Setting("prompt_cache_snapshot_capacity_bytes", ("--prompt-cache-snapshot-capacity-bytes",), type="int",
            minimum=0, group="cache", upstream=False, default_doc="model-aware, at least 512 MiB",
            help="Byte budget of the session snapshot store (recurrent and sliding-window models)."),
    Setting("prompt_cache_snapshot_max_entries", ("--prompt-cache-snapshot-max-entries",), type="int",
            default=4096, minimum=1, group="cache", upstream=False,
            help="Maximum number of session snapshots."),
    Setting("prompt_cache_snapshot_ttl", ("--prompt-cache-snapshot-ttl",), type="int", default=7200, minimum=0,
            group="cache", upstream=False, metavar="SECONDS", help="Seconds a snapshot lives after its last use."),
    Setting("prompt_cache_dir", ("--prompt-cache-dir",), group="cache", upstream=False, metavar="DIR",
            help="Disk tier of the prompt cache (off when unset): entries that leave RAM are written here and "
                 "read back on a miss, and RAM is written here at a clean shutdown, so the cache survives "
                 "restarts. Created if missing; several servers may share it."),
    Setting("prompt_cache_disk_capacity_bytes", ("--prompt-cache-disk-capacity-bytes",), type="int", minimum=0,
            group="cache", upstream=False,
            default_doc="half of the free space plus the cache's files, at most 16 GiB",
            help="Byte budget of the disk tier; the oldest files are deleted first."),
    Setting("prompt_cache_write_through", ("--prompt-cache-write-through",), type="bool", default=False,
            negative_flags=("--no-prompt-cache-write-through",), group="cache", upstream=False,
            help="Write each new prompt-cache entry to --prompt-cache-dir as soon as it is stored, not only when "
                 "it leaves RAM. For replicas sharing one directory: each finds the others' entries while "
                 "running, so a shared system prompt is prefilled once for all of them. Costs a disk write "
                 "per stored entry."),
    Setting("disable_boundary_snapshot", type="bool", default=False, group="cache", upstream=False,
            help="Turn off history-boundary snapshots in chats (environment only)."),
    Setting("disable_cache_warmup", type="bool", default=False, group="cache", upstream=False,
            help="Turn off the background warm-up of a session's next turn (environment only)."),
    Setting("apc_trace", type="bool", default=False, group="cache", upstream=False,
            help="Log one line per prompt-cache decision (environment only)."),
    Setting("cache_ram", ("-cram", "--cache-ram"), ("LLAMA_ARG_CACHE_RAM",), type="int", minimum=-1, group="cache",
            metavar="N", reason="unset, the budget is this cache's model-aware one, not llama-server's 8192 MiB; "
                                "--prompt-cache-capacity-bytes wins over it", default_doc="unset: the model-aware budget of --prompt-cache-capacity-bytes",
            help="RAM budget of the prompt cache in MiB (-1 no limit, 0 turns the cache off), as llama-server's. "
                 "--prompt-cache-capacity-bytes wins where both are given; --prompt-cache-enabled given on "
                 "the command line wins over -cram 0."),
    _noop("cache_idle_slots", ("--cache-idle-slots",), "Save idle slots to the RAM cache.", R_SLOTS,
          env=("LLAMA_ARG_CACHE_IDLE_SLOTS",), negative_flags=("--no-cache-idle-slots",), group="cache"),
    Setting("kv_unified", ("-kvu", "--kv-unified"), ("LLAMA_ARG_KV_UNIFIED",), type="bool", default=False,
            negative_flags=("-no-kvu", "--no-kv-unified"), group="cache", default_doc="on when -np is auto",
            help="Every slot may use the whole --ctx-size (one shared KV budget) instead of ctx-size / parallel "
                 "tokens each. Always on when --parallel is auto (-1), as in llama-server."),
    _noop("ctx_checkpoints", ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"), "Context checkpoints per slot.",
          "the session snapshot store plays this role; see --prompt-cache-snapshot-*", metavar="N",
          env=("LLAMA_ARG_CTX_CHECKPOINTS",), group="cache", type="int"),
    _noop("checkpoint_min_step", ("-cms", "--checkpoint-min-step"), "Minimum spacing of checkpoints.",
          "the session snapshot store plays this role; see --prompt-cache-snapshot-*", metavar="N",
          env=("LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT",), group="cache", type="int"),
    _noop("slot_prompt_similarity", ("-sps", "--slot-prompt-similarity"), "Prompt similarity to reuse a slot.",
          R_SLOTS, metavar="SIMILARITY", group="cache", type="float"),
    _noop("swa_full", ("--swa-full",), "Full-size sliding-window cache.",
          "sliding-window models keep mlx-lm's rotating cache; prefix reuse goes through snapshots",
          env=("LLAMA_ARG_SWA_FULL",), group="cache"),
    Setting("context_shift", ("--context-shift",), ("LLAMA_ARG_CONTEXT_SHIFT",), type="bool", default=False,
            negative_flags=("--no-context-shift",), group="cache",
            help="Context shift on infinite text generation: when a generation fills its slot's context, keep the "
                 "first n_keep tokens (--keep), drop half of the rest (n_discard) and go on. Off by default, as in "
                 "llama-server; models with recurrent state or sliding windows cannot shift (docs/configuration.md)."),
    Setting("cache_type_k", ("-ctk", "--cache-type-k"), ("LLAMA_ARG_CACHE_TYPE_K",), type="choice",
            choices=KV_CACHE_TYPES, default="f16", group="cache", metavar="TYPE", accepts=KV_CACHE_TYPES_ACCEPT,
            help="KV cache type for K: the keys are stored in this type, and attention reads them as stored "
                 "(docs/prompt-cache.md, KV precision). f16 as llama-server; f32 keeps the float32 values the "
                 "model computes (the exactness mode: -ctk f32 -ctv f32); q8_0 and q4_0 store ggml's 32-value "
                 "blocks (the head size a multiple of 32). May differ from -ctv."),
    Setting("cache_type_v", ("-ctv", "--cache-type-v"), ("LLAMA_ARG_CACHE_TYPE_V",), type="choice",
            choices=KV_CACHE_TYPES, default="f16", group="cache", metavar="TYPE", accepts=KV_CACHE_TYPES_ACCEPT,
            help="KV cache type for V (as -ctk for the values)."),
    _noop("defrag_thold", ("-dt", "--defrag-thold"), "KV defragmentation threshold (deprecated upstream).",
          "there is no KV defragmentation", metavar="N", env=("LLAMA_ARG_DEFRAG_THOLD",), group="cache"),
)

_LOGGING: tuple[Setting, ...] = (
    Setting("verbose", ("-v", "--verbose", "--log-verbose"), type="bool", default=False, group="logging",
            help="Log everything (debug level); responses then carry __verbose."),
    Setting("log_verbosity", ("-lv", "--verbosity", "--log-verbosity"), ("LLAMA_ARG_LOG_VERBOSITY",), type="int",
            default=3, group="logging",
            help="Log threshold: 0 output, 1 error, 2 warning, 3 info, 4 trace, 5 debug."),
    Setting("log_disable", ("--log-disable",), type="bool", default=False, group="logging",
            help="Turn logging off."),
    Setting("log_file", ("--log-file",), ("LLAMA_ARG_LOG_FILE",), metavar="FNAME", group="logging",
            help="Also write the log to this file (appended to; stderr keeps it too)."),
    Setting("log_colors", ("--log-colors",), ("LLAMA_ARG_LOG_COLORS",), type="choice", choices=("on", "off", "auto"),
            reason="the --log-file copy is never coloured",
            default="auto", metavar="[on|off|auto]",
            arity="optional", parse=_parse_tristate, accepts="on, off or auto (or a true/false word)",
            group="logging",
            help="Colour the level marks (ANSI codes): auto = only where stderr is a terminal. The log file "
                 "never gets colours."),
    Setting("log_prefix", ("--log-prefix",), ("LLAMA_ARG_LOG_PREFIX",), type="bool", default=False,
            negative_flags=("--no-log-prefix",), group="logging",
            help="Start each log line with llama.cpp's level mark (I, W, E, D) instead of Python's "
                 "'LEVEL logger:' words."),
    Setting("log_timestamps", ("--log-timestamps",), ("LLAMA_ARG_LOG_TIMESTAMPS",), type="bool", default=False,
            negative_flags=("--no-log-timestamps",), group="logging",
            help="With --log-prefix: the time since start-up before the level mark, as llama.cpp writes it "
                 "(minutes.seconds.milliseconds.microseconds)."),
    _noop("log_prompts_dir", ("--log-prompts-dir",), "Write prompts to a directory (debugging).",
          "prompts are never logged", metavar="PATH", group="logging"),
    _noop("perf", ("--perf",), "libllama performance timings.", "timings are always reported in responses",
          env=("LLAMA_ARG_PERF",), negative_flags=("--no-perf",), group="logging"),
)


def _spec(name: str, flags: tuple[str, ...], help: str, *, metavar: str = "N", env: tuple[str, ...] = (),
          negative_flags: tuple[str, ...] = ()) -> Setting:
    return _noop(name, flags, help, R_SPEC, metavar=metavar, env=env, negative_flags=negative_flags)


_COMPAT: tuple[Setting, ...] = (
    _refused("cache_list", ("-cl", "--cache-list"), "List cached GGUF models and exit.", R_COMMAND),
    _refused("completion_bash", ("--completion-bash",), "Print a bash completion script and exit.", R_COMMAND),
    _refused("list_devices", ("--list-devices",), "List devices and exit.", R_COMMAND),
    Setting("threads", ("-t", "--threads"), ("LLAMA_ARG_THREADS",), type="int", default=-1, metavar="N",
            reason="unset, every CPU the process may use (llama-server: its count of physical cores); MLX's own "
                   "threads are not counted",
            parse=_parse_threads, accepts="an integer (<= 0: every CPU)", group="model",
            help="CPU threads of the CPU runtime: the decode kernels' thread pool and, unless -tb says "
                 "otherwise, OpenBLAS and ggml's prompt products (-1 = every CPU the process may use)."),
    Setting("threads_batch", ("-tb", "--threads-batch"), type="int", metavar="N",
            parse=_parse_threads, accepts="an integer (<= 0: every CPU)", group="model",
            default_doc="same as --threads",
            help="CPU threads for prompt chunks: ggml's thread pool for prompt products and OpenBLAS (which "
                 "computes prefill's float32 products); <= 0: every CPU."),
    _noop("cpu_mask", ("-C", "--cpu-mask"), "CPU affinity mask.", R_THREADS, metavar="M"),
    _noop("cpu_range", ("-Cr", "--cpu-range"), "CPU affinity range.", R_THREADS, metavar="lo-hi"),
    _noop("cpu_strict", ("--cpu-strict",), "Strict CPU placement.", R_THREADS, metavar="<0|1>"),
    _noop("prio", ("--prio",), "Thread priority.", R_THREADS, metavar="N"),
    _noop("poll", ("--poll",), "Polling level.", R_THREADS, metavar="<0...100>"),
    _noop("cpu_mask_batch", ("-Cb", "--cpu-mask-batch"), "CPU affinity mask (batch).", R_THREADS, metavar="M"),
    _noop("cpu_range_batch", ("-Crb", "--cpu-range-batch"), "CPU affinity range (batch).", R_THREADS,
          metavar="lo-hi"),
    _noop("cpu_strict_batch", ("--cpu-strict-batch",), "Strict CPU placement (batch).", R_THREADS,
          metavar="<0|1>"),
    _noop("prio_batch", ("--prio-batch",), "Thread priority (batch).", R_THREADS, metavar="N"),
    _noop("poll_batch", ("--poll-batch",), "Polling (batch).", R_THREADS, metavar="<0|1>"),
    _noop("numa", ("--numa",), "NUMA strategy.", R_THREADS, metavar="TYPE", env=("LLAMA_ARG_NUMA",)),
    _noop("flash_attn", ("-fa", "--flash-attn"), "Flash attention (on/off/auto).",
          "MLX picks its attention kernel itself; -fa off with a quantized V cache (-ctv q8_0/q4_0) is refused, "
          "as llama-server refuses it", metavar="[on|off|auto]", arity="optional",
          env=("LLAMA_ARG_FLASH_ATTN",)),
    _noop("n_gpu_layers", ("-ngl", "--gpu-layers", "--n-gpu-layers"), "Layers to offload to the GPU.", R_DEVICE,
          metavar="N", env=("LLAMA_ARG_N_GPU_LAYERS",)),
    _noop("split_mode", ("-sm", "--split-mode"), "How to split the model across GPUs.", R_DEVICE,
          metavar="{none,layer,row,tensor}", env=("LLAMA_ARG_SPLIT_MODE",)),
    _noop("tensor_split", ("-ts", "--tensor-split"), "Fraction of the model per GPU.", R_DEVICE,
          metavar="N0,N1,...", env=("LLAMA_ARG_TENSOR_SPLIT",)),
    _noop("main_gpu", ("-mg", "--main-gpu"), "GPU for the model or intermediate results.", R_DEVICE,
          metavar="INDEX", env=("LLAMA_ARG_MAIN_GPU",)),
    _noop("device", ("-dev", "--device"), "Devices to offload to.", R_DEVICE, metavar="<dev1,dev2,..>",
          env=("LLAMA_ARG_DEVICE",)),
    _noop("fit", ("-fit", "--fit"), "Adjust unset options to fit device memory.", R_FIT, metavar="[on|off]",
          arity="optional", env=("LLAMA_ARG_FIT",)),
    _noop("fit_target", ("-fitt", "--fit-target"), "Memory margin per device for --fit.", R_FIT,
          metavar="MiB0,MiB1,...", env=("LLAMA_ARG_FIT_TARGET",)),
    _noop("fit_ctx", ("-fitc", "--fit-ctx"), "Smallest context --fit may choose.", R_FIT, metavar="N",
          env=("LLAMA_ARG_FIT_CTX",)),
    Setting("mlock", ("--mlock",), ("LLAMA_ARG_MLOCK",), type="bool", default=False, group="model",
            reason="locks the GGUF blocks served from the file; float weights live in MLX arrays and are not locked",
            help="Lock a GGUF's mapped weight blocks in RAM (mlock), so they are never swapped or dropped; a "
                 "warning where RLIMIT_MEMLOCK forbids it. Float weights, which MLX holds, are not locked."),
    Setting("mmap", ("--mmap",), ("LLAMA_ARG_MMAP",), type="bool", default=True, negative_flags=("--no-mmap",),
            group="model",
            help="Serve a GGUF's quantized weight blocks from a map of the file (pages shared with the page "
                 "cache). --no-mmap: read them into the process's own memory instead."),
    _noop("direct_io", ("-dio", "--direct-io"), "Load with direct I/O.", R_LOADING, env=("LLAMA_ARG_DIO",),
          negative_flags=("-ndio", "--no-direct-io")),
    _noop("load_mode", ("-lm", "--load-mode"), "Model loading mode.", R_LOADING, metavar="MODE",
          env=("LLAMA_ARG_LOAD_MODE",)),
    _noop("override_tensor", ("-ot", "--override-tensor"), "Tensor buffer type overrides.", R_LOADING,
          metavar="PATTERN=TYPE,...", env=("LLAMA_ARG_OVERRIDE_TENSOR",)),
    _noop("cpu_moe", ("-cmoe", "--cpu-moe"), "Keep MoE weights on the CPU.", R_LOADING, env=("LLAMA_ARG_CPU_MOE",)),
    _noop("n_cpu_moe", ("-ncmoe", "--n-cpu-moe"), "Keep MoE weights of N layers on the CPU.", R_LOADING,
          metavar="N", env=("LLAMA_ARG_N_CPU_MOE",)),
    _noop("kv_offload", ("-kvo", "--kv-offload"), "Offload the KV cache.", R_LOADING, env=("LLAMA_ARG_KV_OFFLOAD",),
          negative_flags=("-nkvo", "--no-kv-offload")),
    Setting("repack", ("--repack",), ("LLAMA_ARG_REPACK",), type="bool", default=True, group="model",
            negative_flags=("-nr", "--no-repack"),
            help="Serve a quantized GGUF's Q4_0 weights (Q4_K too with a ggml older than 0.25) from ggml's "
                 "repacked layout for this CPU (its int8 GEMV/GEMM), in place of the file's pages. --no-repack: "
                 "the file's blocks only (K-quant prompt chunks keep ggml's tiled kernels either way)."),
    _noop("no_host", ("--no-host",), "Bypass the host buffer.", R_LOADING, env=("LLAMA_ARG_NO_HOST",)),
    _noop("op_offload", ("--op-offload",), "Offload host tensor operations.", R_LOADING,
          negative_flags=("--no-op-offload",)),
    _noop("check_tensors", ("--check-tensors",), "Check tensor data for invalid values.", R_LOADING),
    _noop("pipeline_groups", ("--pipeline-groups",), "Independent contexts for the slots.", R_SLOTS, metavar="N",
          env=("LLAMA_ARG_PIPELINE_GROUPS",)),
    _noop("warmup", ("--warmup",), "Warm up with an empty run.", "the engine always warms the model up",
          negative_flags=("--no-warmup",)),
    Setting("rope_scaling", ("--rope-scaling",), ("LLAMA_ARG_ROPE_SCALING_TYPE",), type="choice",
            choices=("none", "linear", "yarn"), group="model", metavar="{none,linear,yarn}",
            default_doc="the model's", help="RoPE scaling type (none drops the model's scaling)."),
    Setting("rope_scale", ("--rope-scale",), ("LLAMA_ARG_ROPE_SCALE",), type="float", minimum=0, group="model",
            metavar="N", default_doc="the model's", help="RoPE context scaling factor: expands the context N times."),
    Setting("rope_freq_base", ("--rope-freq-base",), ("LLAMA_ARG_ROPE_FREQ_BASE",), type="float", minimum=0,
            group="model", metavar="N", default_doc="the model's", help="RoPE base frequency (rope_theta)."),
    Setting("rope_freq_scale", ("--rope-freq-scale",), ("LLAMA_ARG_ROPE_FREQ_SCALE",), type="float", minimum=0,
            group="model", metavar="N", default_doc="the model's",
            help="RoPE frequency scaling factor: expands the context 1/N times (wins over --rope-scale)."),
    Setting("yarn_orig_ctx", ("--yarn-orig-ctx",), ("LLAMA_ARG_YARN_ORIG_CTX",), type="int", minimum=0,
            group="model", metavar="N", default_doc="the model's training context",
            help="YaRN: the model's original context size."),
    _noop("yarn_ext_factor", ("--yarn-ext-factor",), "YaRN extrapolation mix.", R_ROPE, metavar="N",
          env=("LLAMA_ARG_YARN_EXT_FACTOR",)),
    _noop("yarn_attn_factor", ("--yarn-attn-factor",), "YaRN attention factor.", R_ROPE, metavar="N",
          env=("LLAMA_ARG_YARN_ATTN_FACTOR",)),
    Setting("yarn_beta_slow", ("--yarn-beta-slow",), ("LLAMA_ARG_YARN_BETA_SLOW",), type="float", group="model",
            metavar="N", default_doc="the model's, else 1", help="YaRN: high correction dimension (alpha)."),
    Setting("yarn_beta_fast", ("--yarn-beta-fast",), ("LLAMA_ARG_YARN_BETA_FAST",), type="float", group="model",
            metavar="N", default_doc="the model's, else 32", help="YaRN: low correction dimension (beta)."),
    Setting("lookup_cache_static", ("-lcs", "--lookup-cache-static"), group="speculative", metavar="FNAME",
            help="ngram-cache: a static lookup cache (llama.cpp's n-gram cache file, bigram counts over a corpus) "
                 "that weighs the drafted tokens and drafts where the text's own counts do not; read at start-up, "
                 "never written."),
    Setting("lookup_cache_dynamic", ("-lcd", "--lookup-cache-dynamic"), group="speculative", metavar="FNAME",
            help="ngram-cache: a dynamic lookup cache (llama.cpp's n-gram cache file, counts from earlier "
                 "generations), consulted after the text's own counts with stricter thresholds; read at start-up, "
                 "never written (as llama-server)."),
    Setting("pooling", ("--pooling",), ("LLAMA_ARG_POOLING",), type="choice",
            choices=("none", "mean", "cls", "last", "rank"), group="model", default_doc="from the model",
            help="Pooling of embeddings: none (one vector per token, native routes only), mean, cls (first "
                 "token), last, rank (a reranker's score). Default: the GGUF's <arch>.pooling_type or the "
                 "sentence-transformers 1_Pooling config, else none."),
    Setting("embd_normalize", ("--embd-normalize",), type="int", default=2, group="model", minimum=-1,
            reason="llama.cpp reads no variable for it; MLXCEL_EMBD_NORMALIZE works here",
            help="Normalisation of pooled embeddings (a request's embd_normalize wins): -1 none, 0 max "
                 "absolute scaled to int16, 1 taxicab, 2 euclidean, >2 p-norm."),
    _refused("rpc", ("--rpc",), "RPC servers to offload to.", "RPC backends are not supported",
             metavar="SERVERS", env=("LLAMA_ARG_RPC",)),
    Setting("mmproj", ("-mm", "--mmproj"), ("LLAMA_ARG_MMPROJ",), group="model", metavar="FILE",
            help="Multimodal projector GGUF (llama.cpp's clip file: mmproj-*.gguf) served with the -m GGUF "
                 "text model: images through its vision tower. Projector types: gemma3, qwen2.5vl_merger, "
                 "qwen2vl_merger, qwen3vl_merger, idefics3, internvl, mlp (LLaVA 1.5); "
                 "another is refused at start-up, naming it."),
    Setting("mmproj_url", ("-mmu", "--mmproj-url"), ("LLAMA_ARG_MMPROJ_URL",), group="model", metavar="URL",
            help="Download the projector GGUF from URL (into --mmproj FILE when given, else the URL's file name "
                 "in $LLAMA_CACHE, else ~/.cache/llama.cpp; a file already there is used) and serve it as --mmproj."),
    Setting("mmproj_auto", ("--mmproj-auto",), ("LLAMA_ARG_MMPROJ_AUTO",), type="bool", default=True, group="model",
            negative_flags=("--no-mmproj", "--no-mmproj-auto"),
            help="With -hf, also fetch and serve the repository's projector (mmproj-*.gguf), picked as "
                 "llama-server picks it; --no-mmproj serves the text model alone."),
    _noop("mmproj_offload", ("--mmproj-offload",), "GPU offload of the projector.", R_MMPROJ,
          env=("LLAMA_ARG_MMPROJ_OFFLOAD",), negative_flags=("--no-mmproj-offload",)),
    _noop("mmproj_device", ("-mmdev", "--mmproj-device"), "Device of the projector.", R_MMPROJ, metavar="DEVICE",
          env=("MTMD_BACKEND_DEVICE",)),
    Setting("image_min_tokens", ("--image-min-tokens",), ("LLAMA_ARG_IMAGE_MIN_TOKENS",), type="int", default=0,
            group="model", metavar="N",
            help="Minimum tokens per image for a --mmproj projector of dynamic resolution (Qwen-VL: 8 by "
                 "default, as llama.cpp's); 0: the projector's own."),
    Setting("image_max_tokens", ("--image-max-tokens",), ("LLAMA_ARG_IMAGE_MAX_TOKENS",), type="int", default=0,
            group="model", metavar="N",
            help="Maximum tokens per image for a --mmproj projector of dynamic resolution (Qwen-VL: 4096 by "
                 "default, as llama.cpp's); 0: the projector's own."),
    _noop("mtmd_batch_max_tokens", ("--mtmd-batch-max-tokens",), "Image tokens per batch.", R_MMPROJ,
          metavar="N", env=("LLAMA_ARG_MTMD_BATCH_MAX_TOKENS",)),
    _noop("media_path", ("--media-path",), "Directory for file:// media.",
          "file:// images are refused (send data: URIs, or http(s) URLs with --media-fetch)", metavar="PATH"),
    _noop("spec_draft_hf", ("--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft"), "Draft model repository.",
          "a draft model is loaded from a local file or directory (-md); download it first", metavar="USER/MODEL",
          env=("LLAMA_ARG_SPEC_DRAFT_HF_REPO",)),
    Setting("spec_draft_model", ("--spec-draft-model", "-md", "--model-draft"), ("LLAMA_ARG_SPEC_DRAFT_MODEL",),
            metavar="FNAME", group="speculative",
            help="Draft model for speculative decoding (a .gguf file or model directory with the model's "
                 "vocabulary). Without --spec-type it drafts as draft-simple."),
    Setting("spec_type", ("--spec-type",), ("LLAMA_ARG_SPEC_TYPE",), metavar="TYPES", group="speculative",
            default="none", parse=_parse_spec_types,
            accepts="a comma-separated list of none, draft-simple, ngram-simple, ngram-mod, ngram-cache",
            help="Speculative decoding types: ngram-simple (drafts from the text so far; no model needed), "
                 "ngram-mod (drafts from a table of every sequence's n-grams), ngram-cache (lookup decoding: "
                 "drafts from counts of what followed the text's 1- to 4-grams, and of -lcs/-lcd files), "
                 "draft-simple (drafts with -md); several may be given (n-grams are tried first, in this order: "
                 "ngram-simple, ngram-mod, ngram-cache)."),
    _spec("spec_draft_threads", ("--spec-draft-threads", "-td", "--threads-draft"), "Draft threads."),
    _spec("spec_draft_threads_batch", ("--spec-draft-threads-batch", "-tbd", "--threads-batch-draft"),
          "Draft batch threads."),
    _spec("spec_draft_cpu_mask", ("--spec-draft-cpu-mask", "-Cd", "--cpu-mask-draft"), "Draft CPU mask.",
          metavar="M"),
    _spec("spec_draft_cpu_range", ("--spec-draft-cpu-range", "-Crd", "--cpu-range-draft"), "Draft CPU range.",
          metavar="lo-hi"),
    _spec("spec_draft_cpu_strict", ("--spec-draft-cpu-strict", "--cpu-strict-draft"), "Draft strict placement.",
          metavar="<0|1>"),
    _spec("spec_draft_prio", ("--spec-draft-prio", "--prio-draft"), "Draft thread priority."),
    _spec("spec_draft_poll", ("--spec-draft-poll", "--poll-draft"), "Draft polling.", metavar="<0|1>"),
    _spec("spec_draft_cpu_mask_batch", ("--spec-draft-cpu-mask-batch", "-Cbd", "--cpu-mask-batch-draft"),
          "Draft CPU mask (batch).", metavar="M"),
    _spec("spec_draft_cpu_strict_batch", ("--spec-draft-cpu-strict-batch", "--cpu-strict-batch-draft"),
          "Draft strict placement (batch).", metavar="<0|1>"),
    _spec("spec_draft_prio_batch", ("--spec-draft-prio-batch", "--prio-batch-draft"), "Draft priority (batch)."),
    _spec("spec_draft_poll_batch", ("--spec-draft-poll-batch", "--poll-batch-draft"), "Draft polling (batch).",
          metavar="<0|1>"),
    _spec("spec_draft_type_k", ("--spec-draft-type-k", "-ctkd", "--cache-type-k-draft"), "Draft KV type for K.",
          metavar="TYPE", env=("LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K",)),
    _spec("spec_draft_type_v", ("--spec-draft-type-v", "-ctvd", "--cache-type-v-draft"), "Draft KV type for V.",
          metavar="TYPE", env=("LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V",)),
    _spec("spec_draft_override_tensor", ("--spec-draft-override-tensor", "-otd", "--override-tensor-draft"),
          "Draft tensor overrides.", metavar="PATTERN=TYPE,..."),
    _spec("spec_draft_cpu_moe", ("--spec-draft-cpu-moe", "-cmoed", "--cpu-moe-draft"), "Draft MoE on CPU.",
          metavar="", env=("LLAMA_ARG_SPEC_DRAFT_CPU_MOE",)),
    _spec("spec_draft_n_cpu_moe", ("--spec-draft-n-cpu-moe", "--spec-draft-ncmoe", "-ncmoed", "--n-cpu-moe-draft"),
          "Draft MoE layers on CPU.", env=("LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE",)),
    Setting("spec_draft_n_max", ("--spec-draft-n-max",), ("LLAMA_ARG_SPEC_DRAFT_N_MAX",), type="int", default=3,
            minimum=0, group="speculative", metavar="N", help="Tokens the draft model proposes per step, at most."),
    Setting("spec_draft_n_min", ("--spec-draft-n-min",), ("LLAMA_ARG_SPEC_DRAFT_N_MIN",), type="int", default=0,
            minimum=0, group="speculative", metavar="N",
            help="A shorter draft from the draft model is not verified (the step decodes one token)."),
    _spec("spec_draft_p_split", ("--spec-draft-p-split", "--draft-p-split"), "Draft split probability.",
          metavar="P", env=("LLAMA_ARG_SPEC_DRAFT_P_SPLIT",)),
    Setting("spec_draft_p_min", ("--spec-draft-p-min", "--draft-p-min"), ("LLAMA_ARG_SPEC_DRAFT_P_MIN",),
            type="float", default=0.0, minimum=0.0, maximum=1.0, group="speculative", metavar="P",
            help="The draft model stops drafting before a token it gives less than this probability."),
    _spec("spec_draft_backend_sampling", ("--spec-draft-backend-sampling",), "Draft sampling on the backend.",
          metavar="", env=("LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING",),
          negative_flags=("--no-spec-draft-backend-sampling",)),
    _spec("spec_draft_device", ("--spec-draft-device", "-devd", "--device-draft"), "Draft devices.",
          metavar="<dev1,dev2,..>"),
    _spec("spec_draft_ngl", ("--spec-draft-ngl", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"),
          "Draft GPU layers.", env=("LLAMA_ARG_N_GPU_LAYERS_DRAFT",)),
    Setting("spec_ngram_mod_n_min", ("--spec-ngram-mod-n-min",), type="int", default=48, minimum=0, maximum=1024,
            group="speculative", metavar="N", help="ngram-mod: a shorter chain of lookups is no draft."),
    Setting("spec_ngram_mod_n_max", ("--spec-ngram-mod-n-max",), type="int", default=64, minimum=0, maximum=1024,
            group="speculative", metavar="N", help="ngram-mod: tokens drafted per step, at most."),
    Setting("spec_ngram_mod_n_match", ("--spec-ngram-mod-n-match",), type="int", default=24, minimum=1, maximum=1024,
            group="speculative", metavar="N", help="ngram-mod: length of the n-grams hashed into the table."),
    Setting("spec_ngram_simple_size_n", ("--spec-ngram-simple-size-n",), type="int", default=12, minimum=1,
            maximum=1024, group="speculative", metavar="N",
            help="ngram-simple: length of the n-gram looked up in the text so far (a draft is at least this long)."),
    Setting("spec_ngram_simple_size_m", ("--spec-ngram-simple-size-m",), type="int", default=48, minimum=1,
            maximum=1024, group="speculative", metavar="N",
            help="ngram-simple: tokens drafted after a found n-gram, at most."),
    _noop("spec_ngram_simple_min_hits", ("--spec-ngram-simple-min-hits",), "ngram-simple: minimum hits.",
          "ngram-simple drafts from a single earlier occurrence (llama.cpp's simple mode never reads it)", metavar="N"),
    _noop("spec_ngram_map_k_size_n", ("--spec-ngram-map-k-size-n",), "ngram-map-k: lookup n-gram size.",
          R_SPEC_NGRAM, metavar="N"),
    _noop("spec_ngram_map_k_size_m", ("--spec-ngram-map-k-size-m",), "ngram-map-k: draft m-gram size.",
          R_SPEC_NGRAM, metavar="N"),
    _noop("spec_ngram_map_k_min_hits", ("--spec-ngram-map-k-min-hits",), "ngram-map-k: minimum hits.",
          R_SPEC_NGRAM, metavar="N"),
    _noop("spec_ngram_map_k4v_size_n", ("--spec-ngram-map-k4v-size-n",), "ngram-map-k4v: lookup n-gram size.",
          R_SPEC_NGRAM, metavar="N"),
    _noop("spec_ngram_map_k4v_size_m", ("--spec-ngram-map-k4v-size-m",), "ngram-map-k4v: draft m-gram size.",
          R_SPEC_NGRAM, metavar="N"),
    _noop("spec_ngram_map_k4v_min_hits", ("--spec-ngram-map-k4v-min-hits",), "ngram-map-k4v: minimum hits.",
          R_SPEC_NGRAM, metavar="N"),
    Setting("spec_default", ("--spec-default",), type="bool", default=False, group="speculative",
            help="llama-server's default speculative config: ngram-mod with n-match 24, n-min 48, n-max 64."),
    _noop("draft_max", ("--draft", "--draft-n", "--draft-max"), "Removed upstream; older builds' draft size.", R_SPEC_REMOVED, metavar="N", env=("LLAMA_ARG_DRAFT_MAX",)),
    _noop("draft_min", ("--draft-min", "--draft-n-min"), "Removed upstream; older builds' minimum draft size.", R_SPEC_REMOVED, metavar="N", env=("LLAMA_ARG_DRAFT_MIN",)),
    _noop("spec_ngram_size_n", ("--spec-ngram-size-n",), "Removed upstream.", R_SPEC_REMOVED, metavar="N"),
    _noop("spec_ngram_size_m", ("--spec-ngram-size-m",), "Removed upstream.", R_SPEC_REMOVED, metavar="N"),
    _noop("spec_ngram_min_hits", ("--spec-ngram-min-hits",), "Removed upstream.", R_SPEC_REMOVED, metavar="N"),
)

SETTINGS: tuple[Setting, ...] = _SERVER + _LIMITS + _MODEL + _SAMPLING + _CACHE + _LOGGING + _COMPAT
settings_by_name: dict[str, Setting] = {s.name: s for s in SETTINGS}


def _build_flag_index(settings: Sequence[Setting]) -> dict[str, tuple[Setting, bool]]:
    """Every spelling -> (setting, is_negative); a duplicate spelling is a table bug."""
    index: dict[str, tuple[Setting, bool]] = {}
    for s in settings:
        for spelling, negative in [(f, False) for f in s.flags] + [(f, True) for f in s.negative_flags]:
            if spelling in index:
                raise AssertionError(f"flag {spelling} is declared twice ({index[spelling][0].name}, {s.name})")
            index[spelling] = (s, negative)
    return index


def check_table(settings: Sequence[Setting] = SETTINGS) -> None:
    """Fail loudly on an inconsistent table (run at import; cheap)."""
    names = [s.name for s in settings]
    assert len(names) == len(set(names)), "duplicate setting names"
    reserved = {"sources", "ignored", "is_set", "positions"}
    envs: dict[str, str] = {}
    for s in settings:
        assert s.name.isidentifier() and s.name not in reserved, f"{s.name=}"
        assert s.type in TYPES and s.status in STATUSES and s.arity in ARITIES, f"{s.name=} {s.type=} {s.status=}"
        assert s.group in dict(GROUPS), f"{s.name=} {s.group=}"
        assert (s.type == "choice") == bool(s.choices), f"{s.name=} choices need type choice"
        assert not s.negative_flags or s.type == "bool", f"{s.name=} negative flags need a bool"
        assert s.status == "supported" or s.reason, f"{s.name=} needs a reason"
        assert all(f.startswith("-") for f in s.flags + s.negative_flags), f"{s.name=}"
        for env in s.env_lookup:
            assert env not in envs, f"env {env} used by {envs[env]} and {s.name}"
            envs[env] = s.name
    _build_flag_index(settings)


check_table()
_FLAG_INDEX = _build_flag_index(SETTINGS)


# --------------------------------------------------------------------------- command line


@dataclass(frozen=True)
class CliValue:
    """One occurrence of a flag: the spelling used and its raw value.

    ``value`` is True/False for a bare flag (False for a negative spelling), a string for a
    flag with one value and a 2-tuple for a ``pair`` flag.
    """

    spelling: str
    value: bool | str | tuple[str, str]
    position: int = -1  # index of the flag in argv (orders items across flags: --lora, --lora-scaled)


def _looks_like_value(token: str) -> bool:
    """For optional values: ``-fa`` followed by ``-m`` must not eat the ``-m``."""
    if not token.startswith("-"):
        return True
    try:
        float(token)
        return True
    except ValueError:
        return False


def _split_flag(token: str) -> tuple[str, str | None]:
    """``--name=value`` -> (name, value); ``--long_name`` is llama.cpp's ``--long-name``."""
    name, sep, inline = token.partition("=")
    if name.startswith("--"):
        name = name.replace("_", "-")
    return name, (inline if sep else None)


def parse_argv(argv: Sequence[str]) -> dict[str, list[CliValue]]:
    """Split argv into flag occurrences per setting name, with llama.cpp's arity rules."""
    found: dict[str, list[CliValue]] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        position = i
        i += 1
        name, inline = _split_flag(token)
        hit = _FLAG_INDEX.get(name) if token.startswith("-") else None
        if hit is None:
            raise SettingsError(f"invalid argument: {token}")
        setting, negative = hit
        value: bool | str | tuple[str, str]
        if negative or setting.arity == "flag":
            if inline is not None and (negative or setting.type != "bool"):
                raise SettingsError(f"argument {name} does not take a value")
            value = (not negative) if inline is None else inline
        elif setting.arity == "pair":
            if inline is not None or i + 2 > len(argv):
                raise SettingsError(f"argument {name} expects two values")
            value = (argv[i], argv[i + 1])
            i += 2
        elif inline is not None:
            value = inline
        elif setting.arity == "optional":
            value = True
            if i < len(argv) and _looks_like_value(argv[i]):
                value = argv[i]
                i += 1
        elif i < len(argv):
            value = argv[i]
            i += 1
        else:
            raise SettingsError(f"expected value for argument: {name}")
        found.setdefault(setting.name, []).append(CliValue(name, value, position))
    return found


# --------------------------------------------------------------------------- resolution


@dataclass
class _Resolved:
    value: Any
    source: str  # "cli", "env:NAME" or "default"
    spelling: str = ""  # flag or variable as given, for messages and the ignored list


def _is_hex_byte(text: str) -> bool:
    return len(text) == 2 and all(c in "0123456789abcdefABCDEF" for c in text)


def _process_escapes(text: str) -> str:
    """C-style escapes as llama.cpp's --escape does: \\n \\r \\t \\' \\" \\\\ and \\xNN."""
    simple = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        nxt = text[i + 1] if i + 1 < len(text) else ""
        if ch == "\\" and nxt in simple:
            out.append(simple[nxt])
            i += 2
        elif ch == "\\" and nxt == "x" and _is_hex_byte(text[i + 2:i + 4]):
            out.append(chr(int(text[i + 2:i + 4], 16)))
            i += 4
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _convert(setting: Setting, raw: str, where: str) -> Any:
    """Parse one raw string for ``setting``; errors name ``where`` and the accepted values."""
    try:
        if setting.parse is not None:
            value = setting.parse(raw)
        elif setting.type == "choice":
            if raw not in setting.choices:
                raise ValueError(raw)
            value = raw
        else:
            value = _TYPE_PARSERS.get(setting.type, str)(raw)
    except ValueError:
        raise SettingsError(f"invalid value for {where}: {raw!r}; expected {_accepts(setting)}") from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if setting.minimum is not None and value < setting.minimum:
            raise SettingsError(f"invalid value for {where}: {raw!r}; must be >= {setting.minimum:g}")
        if setting.maximum is not None and value > setting.maximum:
            raise SettingsError(f"invalid value for {where}: {raw!r}; must be <= {setting.maximum:g}")
    return value


def _list_items(setting: Setting, raw: str) -> list[str]:
    if setting.separator is None:
        return [raw]
    return [item.strip() for item in raw.split(setting.separator) if item.strip()]


def _finish_list(setting: Setting, items: list[str]) -> tuple[str, ...]:
    if setting.list_reset and setting.list_reset in items:
        last = len(items) - 1 - items[::-1].index(setting.list_reset)
        items = items[last + 1:]
    return tuple(items)


def _from_cli(setting: Setting, occurrences: list[CliValue]) -> Any:
    if setting.status == "noop":
        # Ignored options keep their raw value: parsing them could only reject a harmless typo.
        if setting.type == "list":
            return tuple(str(o.value) for o in occurrences)
        return occurrences[-1].value
    if setting.type == "list":
        items: list[str] = []
        for occ in occurrences:
            items.extend(_list_items(setting, str(occ.value)))
        return _finish_list(setting, items)
    last = occurrences[-1]  # llama.cpp: a repeated scalar flag keeps its last value
    if isinstance(last.value, bool):  # a bare optional flag: "on" where the setting is on/off/auto
        return "on" if last.value and setting.type == "choice" and "on" in setting.choices else last.value
    if isinstance(last.value, tuple):
        return last.value
    return _convert(setting, last.value, last.spelling)


def _from_env(setting: Setting, name: str, raw: str) -> Any:
    if name in setting.negative_env:
        return False  # llama.cpp: LLAMA_ARG_NO_<X> turns the option off whatever its value
    if setting.status == "noop":
        return raw
    if setting.type == "list":
        return _finish_list(setting, _list_items(setting, raw))
    return _convert(setting, raw, name)


def _resolve_one(setting: Setting, cli: list[CliValue] | None, environ: Mapping[str, str],
                 skip_env: frozenset[str]) -> _Resolved:
    if cli:
        return _Resolved(_from_cli(setting, cli), "cli", cli[-1].spelling)
    for name in setting.env_lookup:
        if name in environ and name not in skip_env:
            return _Resolved(_from_env(setting, name, environ[name]), f"env:{name}", name)
    default = dict(setting.default) if isinstance(setting.default, dict) else setting.default
    return _Resolved(default, "default")


def _cache_reuse_skip(cli: Mapping[str, list[CliValue]], environ: Mapping[str, str]) -> frozenset[str]:
    """LLAMA_ARG_CACHE_REUSE is read only when the cache switch is not set explicitly."""
    switch_env = settings_by_name["prompt_cache_enabled"].mlxcel_env
    if "prompt_cache_enabled" in cli or switch_env in environ:
        return frozenset(settings_by_name["cache_reuse"].env)
    return frozenset()


def _apply_cache_switch(resolved: dict[str, _Resolved]) -> None:
    """Decide prompt_cache_enabled from its own flag, --no-cache-prompt and --cache-reuse.

    Order: --prompt-cache-enabled > cache_prompt false (any source) > --cache-reuse >
    MLXCEL_PROMPT_CACHE_ENABLED > LLAMA_ARG_CACHE_REUSE (or MLXCEL_CACHE_REUSE) > default.
    """
    switch = resolved["prompt_cache_enabled"]
    cache_prompt = resolved["cache_prompt"]
    reuse = resolved["cache_reuse"]
    if switch.source == "cli":
        return
    if cache_prompt.value is False:
        resolved["prompt_cache_enabled"] = _Resolved(False, cache_prompt.source, cache_prompt.spelling)
    elif reuse.source == "cli" or (reuse.source != "default" and switch.source == "default"):
        resolved["prompt_cache_enabled"] = _Resolved(reuse.value > 0, reuse.source, reuse.spelling)


CACHE_RAM_UNLIMITED = 1 << 62  # -cram -1: a byte budget no machine reaches (entries and TTL still bound it)


def _apply_cache_ram(resolved: dict[str, _Resolved]) -> None:
    """``-cram N`` (llama-server's prompt-cache budget in MiB) as this cache's byte budget.

    ``--prompt-cache-capacity-bytes`` (this server's own, finer option) wins from any source;
    otherwise N > 0 is N MiB, -1 no limit, and 0 turns the cache off, unless
    ``--prompt-cache-enabled`` was given on the command line. Unset, the model-aware default stays.
    """
    ram = resolved["cache_ram"]
    if ram.source == "default" or ram.value is None:
        return
    if ram.value == 0:
        if resolved["prompt_cache_enabled"].source != "cli":
            resolved["prompt_cache_enabled"] = _Resolved(False, ram.source, ram.spelling)
        return
    if resolved["prompt_cache_capacity_bytes"].source == "default":
        budget = CACHE_RAM_UNLIMITED if ram.value < 0 else ram.value << 20
        resolved["prompt_cache_capacity_bytes"] = _Resolved(budget, ram.source, ram.spelling)


def _check_tls(resolved: Mapping[str, _Resolved]) -> None:
    """llama-server serves HTTPS only with both files; one alone is a mistake worth stopping for."""
    key, cert = resolved["ssl_key_file"], resolved["ssl_cert_file"]
    if bool(key.value) != bool(cert.value):
        given, missing = (key, "--ssl-cert-file") if key.value else (cert, "--ssl-key-file")
        raise SettingsError(f"{given.spelling} needs {missing} too (HTTPS takes a key and a certificate)")


def _check_kv_types(resolved: Mapping[str, _Resolved]) -> None:
    """-ctk and -ctv may differ, as in llama-server; a quantized V cache needs flash attention
    there (llama-context.cpp refuses it with ``-fa off``), so ``-fa off`` with ``-ctv q8_0`` or
    ``q4_0`` is refused here too rather than served in a configuration llama-server rejects."""
    v, fa = resolved["cache_type_v"], resolved["flash_attn"]
    if v.value in ("q8_0", "q4_0") and str(fa.value).lower() in ("off", "0", "false", "disabled"):
        raise SettingsError(f"{v.spelling or '-ctv'} {v.value}: quantized V cache requires flash_attn to be enabled "
                            f"(remove {fa.spelling or '-fa'} off, or store V as f16)")


def _apply_escapes(resolved: dict[str, _Resolved]) -> None:
    if not resolved["escape"].value:
        return
    for s in SETTINGS:
        item = resolved[s.name]
        if s.escapes and item.source != "default":
            item.value = tuple(_process_escapes(v) for v in item.value)


def _is_active(value: Any) -> bool:
    """Whether a refused option was really asked for (``--no-agent`` or an empty value is fine)."""
    if isinstance(value, bool):
        return value
    return value not in (None, "", ())


def _check_refused(resolved: Mapping[str, _Resolved]) -> None:
    for s in SETTINGS:
        item = resolved[s.name]
        if s.status == "refused" and item.source != "default" and _is_active(item.value):
            raise SettingsError(f"{item.spelling} is not supported by mlxcel_compat: {s.reason}")


def _print_and_exit(text: str) -> None:
    print(text)
    raise SystemExit(0)


def resolve_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Resolve every setting once, at start-up (CLI > MLXCEL_* > llama.cpp env > default).

    Raises ``SettingsError`` for an unknown flag, a malformed value or a refused option;
    ``--help`` and ``--version`` print and raise ``SystemExit(0)``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if environ is None else environ
    cli = parse_argv(args)
    if "help" in cli:
        _print_and_exit(render_help())
    if "version" in cli:
        from mlxcel_compat import __version__

        _print_and_exit(f"mlxcel_compat {__version__}")
    skip_env = _cache_reuse_skip(cli, env)
    resolved = {s.name: _resolve_one(s, cli.get(s.name), env, skip_env) for s in SETTINGS}
    _apply_cache_switch(resolved)
    _apply_cache_ram(resolved)
    _check_tls(resolved)
    _check_kv_types(resolved)
    _apply_escapes(resolved)
    _check_refused(resolved)
    _check_lora_scaled(resolved)
    _check_tools(resolved)
    ignored = [(resolved[s.name].spelling, s.reason) for s in SETTINGS
               if s.status == "noop" and resolved[s.name].source != "default"]
    values = {name: item.value for name, item in resolved.items()}
    sources = MappingProxyType({name: item.source for name, item in resolved.items()})
    return Settings(**values, sources=sources, ignored=ignored, positions=_list_positions(cli))


def _list_positions(cli: Mapping[str, list[CliValue]]) -> Mapping[str, tuple[int, ...]]:
    """For list settings given on the command line: the argv position of each resolved item."""
    out: dict[str, tuple[int, ...]] = {}
    for name, occurrences in cli.items():
        setting = settings_by_name[name]
        if setting.type == "list" and setting.status != "noop" and not setting.list_reset:
            out[name] = tuple(o.position for o in occurrences for _ in _list_items(setting, str(o.value)))
    return MappingProxyType(out)


def _check_lora_scaled(resolved: Mapping[str, _Resolved]) -> None:
    """``--lora-scaled`` items are FNAME:SCALE, split as llama-server splits them."""
    from mlxcel_compat.lora.adapters import parse_scaled

    item = resolved["lora_scaled"]
    for value in item.value or ():
        try:
            parse_scaled(value)
        except ValueError:
            raise SettingsError(f"invalid value for {item.spelling}: {value!r}; expected FNAME:SCALE") from None


def _check_tools(resolved: Mapping[str, _Resolved]) -> None:
    """``--tools`` names, checked at start-up with llama-server's message."""
    from mlxcel_compat.server.agent_tools import select_tools

    item = resolved["tools"]
    try:
        select_tools(item.value or ())
    except ValueError as exc:
        raise SettingsError(f"{item.spelling}: {exc}") from None
    from mlxcel_compat.server.mcp_client import load_configs

    try:
        load_configs(resolved["mcp_servers_config"].value, resolved["mcp_servers_json"].value)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def server_tools(settings: Any) -> tuple[str, ...]:
    """The tools asked for: ``--tools``, or every one with ``--agent``."""
    return ("all",) if settings.agent else tuple(settings.tools or ())


def mcp_proxy_enabled(settings: Any) -> bool:
    return bool(settings.ui_mcp_proxy or settings.agent)


def cors_origins(settings: Any) -> str:
    """``--cors-origins``; with tools or MCP servers and no explicit value, llama-server's ``localhost``."""
    mcp = settings.mcp_servers_config or settings.mcp_servers_json
    if (server_tools(settings) or mcp) and not settings.is_set("cors_origins"):
        return "localhost"
    return settings.cors_origins


def make_settings(**overrides: Any) -> Settings:
    """Defaults plus ``overrides`` (marked with source "override"); meant for tests and tools."""
    unknown = set(overrides) - set(settings_by_name)
    if unknown:
        raise SettingsError(f"unknown settings: {', '.join(sorted(unknown))}")
    values = {s.name: overrides.get(s.name, dict(s.default) if isinstance(s.default, dict) else s.default)
              for s in SETTINGS}
    sources = MappingProxyType({s.name: "override" if s.name in overrides else "default" for s in SETTINGS})
    return Settings(**values, sources=sources, ignored=[])


def require_model(settings: Settings) -> None:
    """llama-server without -m/-hf starts router mode, which mlxcel_compat does not offer."""
    if not (settings.model or settings.hf_repo):
        raise SettingsError("no model given: pass -m PATH or -hf REPO (router mode is not supported)")


def default_template_kwargs(settings: Settings) -> dict[str, Any]:
    """Server-wide chat template variables: --chat-template-kwargs, then --reasoning on/off and
    --[no-]reasoning-preserve when given (``preserve_reasoning`` is on by default: chat/render.py)."""
    kwargs = dict(settings.chat_template_kwargs)
    if settings.reasoning in ("on", "off"):
        kwargs["enable_thinking"] = settings.reasoning == "on"
    if settings.is_set("reasoning_preserve"):
        kwargs["preserve_reasoning"] = bool(settings.reasoning_preserve)
    return kwargs


def _is_set(self: Any, name: str) -> bool:
    """True when ``name`` did not come from its default (CLI, environment or override)."""
    if name not in settings_by_name:
        raise KeyError(name)
    return self.sources[name] != "default"


Settings = dataclasses.make_dataclass(
    "Settings",
    [(s.name, Any, field(repr=not s.secret)) for s in SETTINGS]
    + [("sources", Mapping[str, str], field(repr=False)),
       ("ignored", list[tuple[str, str]], field(default_factory=list, repr=False)),
       ("positions", Mapping[str, tuple[int, ...]], field(default_factory=dict, repr=False))],
    namespace={"is_set": _is_set, "__module__": __name__},
    frozen=True,
)
Settings.__doc__ = (
    "Resolved configuration: one attribute per entry of SETTINGS, plus ``sources`` "
    "(name -> 'cli' | 'env:NAME' | 'default' | 'override'), ``ignored`` ((flag or variable, reason) "
    "for every noop option that was given) and ``is_set(name)``."
)


# --------------------------------------------------------------------------- help and docs


def _format_default(s: Setting) -> str:
    if s.cli_only:
        return ""
    if s.default_doc:
        return s.default_doc
    value = s.default
    if value is None or value == ():
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, dict)):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    if isinstance(value, str) and (value == "" or not value.isprintable()):
        return json.dumps(value)
    return str(value)


def _env_names(s: Setting) -> list[str]:
    names = [s.mlxcel_env] if s.mlxcel_env else []
    return names + list(s.env) + list(s.negative_env)


def _metavar(s: Setting) -> str:
    if s.metavar:
        return s.metavar
    if s.type == "choice":
        return "{" + ",".join(s.choices) + "}"
    return {"int": "N", "float": "N", "json": "JSON"}.get(s.type, "VALUE")


def _type_label(s: Setting) -> str:
    if s.type == "choice":
        return "choice: " + " | ".join(s.choices)
    return s.type


def _status_note(s: Setting) -> str:
    if s.status == "noop":
        return f"Ignored: {s.reason}."
    if s.status == "refused":
        return f"Refused: {s.reason}."
    return f"Note: {s.reason}." if s.reason else ""


class _FlagAction(argparse.Action):
    """A bare flag: its positive spellings store True, its negative spellings False."""

    def __init__(self, option_strings: list[str], dest: str, negatives: tuple[str, ...] = (), **kwargs: Any):
        self.negatives = negatives
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string not in self.negatives)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # never SystemExit(2) with a usage dump
        raise SettingsError(message)


def build_parser() -> argparse.ArgumentParser:
    """An argparse view of the table (used for --help; raw string values, no env lookup)."""
    parser = _Parser(
        prog="mlxcel-server", usage="mlxcel-server [options]", add_help=False, allow_abbrev=False,
        description="MLX inference server, a drop-in replacement for llama.cpp's llama-server. "
                    "Precedence: flag > MLXCEL_<NAME> > llama.cpp variable (LLAMA_ARG_*, ...) > default.",
        epilog="Booleans in the environment accept " + BOOL_ACCEPTS + ". See docs/configuration.md.",
    )
    for group, title in GROUPS:
        section = parser.add_argument_group(title)
        for s in (s for s in SETTINGS if s.group == group and (s.flags or s.negative_flags)):
            help_text = " ".join(x for x in (s.help, _status_note(s)) if x)
            envs = _env_names(s)
            if envs:
                help_text += f" (env: {', '.join(envs)})"
            default = _format_default(s)
            if default:
                help_text += f" (default: {default})"
            help_text = help_text.replace("%", "%%")
            options = list(s.flags) + list(s.negative_flags)
            if s.arity == "flag":
                section.add_argument(*options, dest=s.name, action=_FlagAction, negatives=s.negative_flags,
                                     default=argparse.SUPPRESS, help=help_text)
            else:
                nargs = {"value": None, "optional": "?", "pair": 2}[s.arity]
                metavar = tuple(_metavar(s).split()) if s.arity == "pair" else _metavar(s)
                section.add_argument(*options, dest=s.name, nargs=nargs, const=True if nargs == "?" else None,
                                     action="append" if s.type == "list" else "store", metavar=metavar,
                                     default=argparse.SUPPRESS, help=help_text)
    return parser


def render_help() -> str:
    return build_parser().format_help()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code_list(items: Sequence[str]) -> str:
    return ", ".join(f"`{_cell(i)}`" for i in items)


_MARKDOWN_INTRO = """\
# Configuration

<!-- Generated by scripts/gen_docs.py from mlxcel_compat/settings.py. Do not edit by hand. -->

Every option of `mlxcel-server` is declared once, in `mlxcel_compat/settings.py`. The command-line
parser, the environment lookup, `--help`, this page and the flag list of
`docs/compat/llama-server.json` are generated from that table. Run `python scripts/gen_docs.py` after
changing it (`--check` fails when this page is stale).

## How a value is chosen

1. a command-line flag;
2. `MLXCEL_<NAME>`, where `<NAME>` is the setting's name in upper case (every setting has one);
3. the llama.cpp variable(s) of the setting (`LLAMA_ARG_*`, `LLAMA_API_KEY`, `HF_TOKEN`, `APC_*`);
4. the default. Defaults described as *model-aware* or *derived* are computed once the model is loaded.

Rules taken from llama-server:

- A flag that takes a value takes the next argument as it is, even when it starts with `-`.
  `--flag=value` works too. In `--long_names`, `_` means `-`. An unknown argument stops start-up
  with `invalid argument: X`. A repeated flag keeps its last value, except list options, which add up.
- Booleans in the environment accept `on`, `enabled`, `true`, `1`, `yes` and `off`, `disabled`,
  `false`, `0`, `no`, in any case. Anything else stops start-up with a message naming the variable.
- For an option with a negative form (`--no-...`), a variable `LLAMA_ARG_NO_<X>` with any value,
  even empty, turns it off.
- List options split their values on commas, except `-r` and `--dry-sequence-breaker`, which take
  one item per flag.
- The prompt cache switch: `--prompt-cache-enabled[=BOOL]` wins; otherwise `--no-cache-prompt`
  (or `LLAMA_ARG_CACHE_PROMPT=false`, `LLAMA_ARG_NO_CACHE_PROMPT`) turns the cache off; otherwise
  `--cache-reuse N`, then `MLXCEL_PROMPT_CACHE_ENABLED`, then `LLAMA_ARG_CACHE_REUSE` decide
  (a positive integer or a true word means on, 0 or a false word means off). `LLAMA_ARG_CACHE_REUSE`
  is not read at all when the flag or `MLXCEL_PROMPT_CACHE_ENABLED` is set.

Status of an option:

- **supported**: it works as in llama-server (a note says where it differs);
- **noop**: accepted, so existing command lines keep working, and logged at start-up as ignored;
- **refused**: start-up fails with a message that says why. Bare flags are refused only when they
  resolve to true, valued ones only when the value is not empty.
"""


def render_markdown() -> str:
    """The full text of docs/configuration.md."""
    lines = [_MARKDOWN_INTRO]
    for group, title in GROUPS:
        lines.append(f"## {title}\n")
        lines.append("| Flags | Environment | Type | Default | Status | Description |")
        lines.append("|---|---|---|---|---|---|")
        for s in (s for s in SETTINGS if s.group == group):
            flags = _code_list(list(s.flags) + list(s.negative_flags)) or "(environment only)"
            default = _format_default(s)
            description = " ".join(x for x in (s.help, _status_note(s)) if x)
            lines.append(
                f"| {flags} | {_code_list(_env_names(s))} | {_cell(_type_label(s))} | "
                f"{'`' + _cell(default) + '`' if default else ''} | {s.status} | {_cell(description)} |"
            )
        lines.append("")
    return "\n".join(lines)
