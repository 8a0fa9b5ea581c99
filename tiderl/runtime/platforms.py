"""Which JAX backend a run uses, how it is started, and what a device plan may assume there.

Pure functions of the cluster config and the environment (no JAX): `launch_env` says what to
set before JAX starts its backends (read once, at backend start: later changes are ignored),
`check_platform` turns "asked for a GPU, JAX found none" into one clear error, and
`resolve_colocate` / `plan_remedy` give a device plan its per-platform defaults and the remedy
its error names. `cluster.init_jax` applies them.

What is set, and why (also in docs/how-to/gpu.md):
- `jax_platforms`: `cpu`; `cuda,cpu` for `gpu`, `tpu,cpu` for `tpu` (the CPU backend stays
  available for host-side work such as reading checkpoints); nothing for `auto`, where JAX takes
  an accelerator whose plugin finds hardware and the CPU otherwise.
- `jax_num_cpu_devices` (`cluster.fake_cpu_devices`) only where the CPU may be the platform:
  fake devices are a CPU notion and never count on a GPU or TPU.
- `XLA_PYTHON_CLIENT_MEM_FRACTION` (`cluster.memory_fraction`, GPU): XLA's GPU allocator
  reserves this share of each GPU at start (default 0.75 without us); everything the run keeps
  on a device — weights, optimizer state, the engine's KV pool
  (`rollout.kv_memory_fraction` of what is free when the engine starts), activations — lives
  inside it. A value already in the environment wins.
- `XLA_FLAGS` additions, keeping the user's own: on GPU `GPU_XLA_FLAGS`; on CPU with
  `trainer.remat` the memory-ordered scheduler (`CPU_LOW_MEMORY_FLAG`). XLA parses every flag
  at start on any backend (an unknown one aborts the process), so these are checked by a test
  against the installed jaxlib.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

from tiderl.configlib import ConfigError

Platform = Literal["auto", "cpu", "gpu", "tpu"]

JAX_PLATFORMS: dict[str, str] = {"cpu": "cpu", "gpu": "cuda,cpu", "tpu": "tpu,cpu"}

GPU_XLA_FLAGS: tuple[str, ...] = (
    # Lets XLA move collectives (the FSDP all-gathers and reduce-scatters of a multi-GPU Actor)
    # to overlap compute; NVIDIA's JAX images set it by default. No effect on one GPU.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
)

CPU_LOW_MEMORY_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
"""XLA:CPU's default scheduler orders for concurrency and runs every rematerialised block's
recomputation ahead of the backward, all live at once, which undoes remat (XLA's own figure for
the backward of a Qwen2.5-0.5B-shaped model at 4 × 1,024 tokens: 24.6 GiB of temporaries,
7.5 GiB with its memory-ordered scheduler)."""


CPU_MMAP_THRESHOLD = 1 << 20
"""Bytes from which glibc's malloc always maps a block on its own (`cpu_low_memory_malloc`)."""


def cpu_low_memory_malloc(*, trim: bool = True) -> bool:
    """Fixes glibc's mmap threshold at `CPU_MMAP_THRESHOLD` (and its trim threshold with it).

    XLA:CPU allocates its buffers with malloc. glibc raises its mmap threshold to the size of
    each mapped block freed (up to 32 MiB), so after the first step's buffers are freed the
    next ones of up to that size come from the heap, whose freed pages stay resident: the
    compiler's and earlier kernels' leftovers add to the backward's peak. With the threshold
    fixed every block of a MiB or more is mapped and unmapped on its own and its memory goes
    back when freed.

    The compiler's own working memory (LLVM's many small blocks, a few hundred MiB for a
    24-layer backward) is freed into the heap, in pieces below the threshold, scattered over
    the threads' arenas, where no trim threshold reaches it; the kernel it compiled then runs
    beside those resident leftovers. So after every XLA compilation `malloc_trim(0)` hands
    the free pages of every arena back (a jax.monitoring listener: compilations are rare, a
    trim takes milliseconds; `trim=False` leaves that out). Returns False where the C library is not glibc (nothing
    changed)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    ok = bool(mallopt(m_mmap_threshold, CPU_MMAP_THRESHOLD)
              and mallopt(m_trim_threshold, CPU_MMAP_THRESHOLD))
    global _TRIM_LISTENING
    if ok and trim and not _TRIM_LISTENING:
        from jax import monitoring

        def trim_after_compile(event: str, duration: float, **_: object) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                malloc_trim(0)
                TRIMS[0] += 1

        monitoring.register_event_duration_secs_listener(trim_after_compile)
        _TRIM_LISTENING = True
    return ok


_TRIM_LISTENING = False
TRIMS = [0]
"""How many times `cpu_low_memory_malloc`'s listener trimmed the heap (one per compilation)."""


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What to set before JAX starts: config values, environment variables, and why."""

    jax_platforms: str | None
    """Value for `jax_platforms`, or None to let JAX choose (`cluster.platform=auto`)."""
    num_cpu_devices: int
    """`jax_num_cpu_devices` to set (0: leave JAX's default of one CPU device)."""
    env: dict[str, str]
    """Environment variables to set (the user's own values already merged in)."""
    notes: tuple[str, ...]
    """One line per setting, for `python -m tiderl.launch --plan`."""


def _merge_flags(current: str, extra: tuple[str, ...]) -> tuple[str, list[str]]:
    """`current` XLA_FLAGS plus the `extra` flags whose name it does not set already."""
    names = {f.split("=", 1)[0] for f in current.split()}
    added = [f for f in extra if f.split("=", 1)[0] not in names]
    return " ".join([*current.split(), *added]), added


def launch_env(platform: str, *, fake_cpu_devices: int, memory_fraction: float,
               environ: Mapping[str, str], low_memory: bool = False) -> LaunchEnv:
    """The settings for `cluster.platform=platform` given the current environment."""
    if platform not in ("auto", *JAX_PLATFORMS):
        raise ConfigError(f"config key 'cluster.platform'={platform!r} is not one of auto, "
                          f"{', '.join(JAX_PLATFORMS)}; set one of them")
    may_cpu = platform in ("auto", "cpu")
    may_gpu = platform in ("auto", "gpu")
    env: dict[str, str] = {}
    notes: list[str] = []
    extra: tuple[str, ...] = ()
    if may_gpu:
        extra += GPU_XLA_FLAGS
    if may_cpu and low_memory:
        extra += (CPU_LOW_MEMORY_FLAG,)
    flags, added = _merge_flags(environ.get("XLA_FLAGS", ""), extra)
    if added:
        env["XLA_FLAGS"] = flags
        notes.append(f"XLA_FLAGS += {' '.join(added)}")
    if may_gpu:
        if "XLA_PYTHON_CLIENT_MEM_FRACTION" in environ:
            notes.append("XLA_PYTHON_CLIENT_MEM_FRACTION="
                         f"{environ['XLA_PYTHON_CLIENT_MEM_FRACTION']} (from the environment; "
                         "cluster.memory_fraction not applied)")
        else:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{memory_fraction:g}"
            notes.append(f"XLA_PYTHON_CLIENT_MEM_FRACTION={memory_fraction:g} "
                         "(cluster.memory_fraction: the share of each GPU XLA reserves)")
    n_cpu = fake_cpu_devices if may_cpu else 0
    if n_cpu:
        notes.append(f"jax_num_cpu_devices={n_cpu} (cluster.fake_cpu_devices; CPU only)")
    return LaunchEnv(JAX_PLATFORMS.get(platform), n_cpu, env, tuple(notes))


def check_platform(requested: str, found: str) -> None:
    """A ConfigError when `cluster.platform` asked for an accelerator JAX did not start.

    `found` is `jax.devices()[0].platform` ('cpu', 'gpu', 'tpu'). With `jax_platforms=cuda,cpu`
    JAX skips CUDA silently when it sees no NVIDIA GPU and falls back to the CPU; a run that
    asked for a GPU must not quietly train on the CPU instead."""
    if requested in ("gpu", "tpu") and found != requested:
        fix = ("install the CUDA build (pip install -e '.[gpu]', i.e. jax[cuda12]) and check "
               "that nvidia-smi lists the GPU and CUDA_VISIBLE_DEVICES does not hide it"
               if requested == "gpu" else "install jax[tpu] on a TPU VM")
        raise ConfigError(f"config key 'cluster.platform'={requested!r} but JAX started on "
                          f"{found!r} (no {requested.upper()} found); {fix}, or set "
                          "cluster.platform=cpu (or auto)")


def resolve_colocate(setting: bool | str, *, platform: str, n_devices: int, separate_need: int,
                     colocated_need: int) -> bool:
    """Whether rollout and training share devices. `setting` is `cluster.colocate_rollout`.

    'auto': on an accelerator whose devices cannot hold rollout and training side by side (one
    GPU) they share them; on the CPU they stay apart (fake devices cost nothing to add)."""
    if isinstance(setting, bool):
        return setting
    return platform != "cpu" and separate_need > n_devices >= colocated_need


def plan_remedy(platform: str, *, colocated: bool = False) -> str:
    """The last clause of a device-plan error: what actually gives more devices on `platform`
    (`colocated`: the roles already share devices, so sharing is no remedy)."""
    if platform == "cpu":
        return "or raise cluster.fake_cpu_devices"
    visible = "CUDA_VISIBLE_DEVICES" if platform == "gpu" else "TPU_VISIBLE_CHIPS"
    share = "" if colocated else ("or set cluster.colocate_rollout=true (rollout and training "
                                  "share the devices), ")
    return f"{share}or run where more {platform.upper()}s are visible ({visible})"
