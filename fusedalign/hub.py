"""Hub names without a reachable hub: fail in seconds, naming the builtin equivalents.

Left alone, `from_pretrained("trl-internal-testing/zen")` on a machine without network
retries for about a minute and ends in a 133-line traceback. Before a hub name is
handed to transformers or datasets, `require_hub` checks (once per process) whether the
hub answers; if it does not, or `HF_HUB_OFFLINE=1`, a name that is not in the local
cache is refused at once, with the builtin resources that stand in for TRL's own test
models and data.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlparse

# TRL's test resources and the builtin ones that stand in for them.
BUILTIN_EQUIVALENTS = {
    "trl-internal-testing/zen": "builtin:zen",
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": "builtin:tiny-qwen2",
    "trl-internal-testing/tiny-LlamaForCausalLM-3.2": "builtin:tiny-llama",
    "trl-internal-testing/tiny-Gemma2ForCausalLM": "builtin:tiny-gemma2",
}
BUILTINS = "builtin:tiny-qwen2, builtin:tiny-llama, builtin:tiny-gemma2 (models), builtin:zen (data)"
PROBE_SECONDS = 3.0

_probe: str | None | bool = False  # False: not probed yet; None: reachable; str: why not


class HubUnreachableError(FileNotFoundError, ValueError):
    """A hub name while the hub cannot be reached and the name is not cached."""


def _offline_flag() -> str | None:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name}={os.environ[name]}"
    return None


def hub_unreachable_reason(timeout: float = PROBE_SECONDS) -> str | None:
    """Why the hub cannot be used now (offline flag, or no TCP connection), or None if it answers."""
    global _probe
    flag = _offline_flag()
    if flag:
        return flag
    if _probe is not False:
        return _probe
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    result: list[str | None] = []

    def connect() -> None:  # DNS is not bounded by a socket timeout: run it where we can stop waiting
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except OSError as err:
            result.append(f"cannot reach {endpoint} ({type(err).__name__}: {err})")

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    _probe = result[0] if result else f"cannot reach {endpoint} (no answer in {timeout:.0f} s)"
    return _probe


def is_cached(repo_id: str, repo_type: str) -> bool:
    """Whether a snapshot of `repo_id` is in the local hub cache."""
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id, repo_type=repo_type, local_files_only=True)
        return True
    except Exception:  # LocalEntryNotFoundError, or an invalid name: not usable offline either way
        return False


def require_hub(repo_id: str, repo_type: str = "model") -> bool:
    """Checks that a hub name can be loaded now; returns whether it must come from the cache.

    Raises:
        HubUnreachableError: the hub cannot be reached (or offline mode is set) and the
            name is not cached; the message names the builtin equivalents.
    """
    reason = hub_unreachable_reason()
    if reason is None:
        return False
    if is_cached(repo_id, repo_type):
        return True
    equivalent = BUILTIN_EQUIVALENTS.get(repo_id)
    hint = f"use its builtin equivalent {equivalent}" if equivalent else f"use a local path or a builtin: {BUILTINS}"
    raise HubUnreachableError(
        f"{repo_type} {repo_id!r} is a hub name, but the Hugging Face hub is not reachable ({reason}) and it is "
        f"not in the local cache; {hint}."
    )
