"""The built-in agent tools that run programs on the host: ``exec_shell_command`` and
``get_info`` (``--tools``).

Limits and result shapes are llama-server's (b11312, ``tools/server/server-tools.cpp``); the
children run through ``agent_host.run_process``. ``exec_shell_command`` is the one tool that
streams (``POST /tools`` with ``stream: true``).
"""

from __future__ import annotations

import os
from typing import Any

from mlxcel_compat.server.agent_host import ExecResult, run_process
from mlxcel_compat.server.agent_params import Chunk, optional, required

EXEC_MAX_OUTPUT_SIZE = 16 * 1024
EXEC_MAX_TIMEOUT = 60
GET_INFO_MAX_OUTPUT = 4096
GET_INFO_TIMEOUT = 5


def exec_shell_command(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any] | None:
    command = required(params, "command", str)
    timeout = min(optional(params, "timeout", 10), EXEC_MAX_TIMEOUT)
    max_output = optional(params, "max_output_size", EXEC_MAX_OUTPUT_SIZE)
    max_output = EXEC_MAX_OUTPUT_SIZE if max_output < 0 else min(max_output, EXEC_MAX_OUTPUT_SIZE)  # size_t in C++
    cwd = params.get("cwd", "")
    if stream is not None:
        alive = [True]

        def push(chunk: str) -> bool:
            alive[0] = stream(chunk)
            return alive[0]

        res = run_process(["sh", "-c", command], max_output, timeout, cwd, push)
        if alive[0]:
            stream(_exit_tail(res))
        return None
    res = run_process(["sh", "-c", command], max_output, timeout, cwd)
    return {"plain_text_response": res.output + _exit_tail(res)}


def _exit_tail(res: ExecResult) -> str:
    return f"\n[exit code: {res.exit_code}]" + (" [exit due to timed out]" if res.timed_out else "")


def get_info(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any]:
    res = run_process(["uname", "-a"], GET_INFO_MAX_OUTPUT, GET_INFO_TIMEOUT, params.get("cwd", ""))
    os_info = res.output.strip() if res.exit_code == 0 and not res.timed_out else "unknown"
    return {"os": os_info, "cwd": params.get("cwd") or os.getcwd()}
