"""The control plane imports without JAX (the simulator runs it on virtual time): checked in a subprocess."""

import importlib.util
import subprocess
import sys

NO_JAX = [
    "tiderl", "tiderl.config", "tiderl.configlib", "tiderl.runtime.devices", "tiderl.runtime.platforms",
    "tiderl.models", "tiderl.models.config", "tiderl.models.tokenizer",
    "tiderl.control", "tiderl.control.controller", "tiderl.control.buffer", "tiderl.control.ers",
    "tiderl.control.metrics", "tiderl.control.config", "tiderl.control.progress",
    "tiderl.control.samples", "tiderl.control.sinks", "tiderl.control.logs", "tiderl.report",
    "tiderl.control.roles", "tiderl.control.boundary", "tiderl.control.plans",
    "tiderl.control.fixed_plans", "tiderl.control.ers_rates", "tiderl.control.ers_config",
    "tiderl.control.starvation",
    "tiderl.control.producer", "tiderl.control.reporting",
    "tiderl.envs", "tiderl.envs.protocol", "tiderl.envs.server", "tiderl.envs.client",
    "tiderl.envs.config", "tiderl.envs.templates", "tiderl.envs.chat_templates", "tiderl.sim",
    "tiderl.sim.costs", "tiderl.sim.device_profile", "tiderl.sim.virtual_engine",
    "tiderl.sim.trainer", "tiderl.sim.workloads",
    "tiderl.sim.envs", "tiderl.sim.host", "tiderl.sim.clock", "tiderl.sim.cluster",
    "tiderl.sim.fakes", "tiderl.sim.run", "tiderl.sim.experiments", "tiderl.sim.validate",
    "tiderl.sim.calibrate", "tiderl.sim.microbench", "tiderl.sim.virtual_ers",
    "tiderl.sim.hostcost", "tiderl.sim.memory", "tiderl.sim.window", "tiderl.sim.vision_tower",
    "tiderl.sim.jobs", "tiderl.sim.fig14",
    "tiderl.envs.tasks", "tiderl.envs.taskfile", "tiderl.envs.rewards", "tiderl.envs.suites",
    "tiderl.envs.health", "tiderl.envs.images", "tiderl.envs.latency", "tiderl.envs.turns",
    "tiderl.envs.sessions",
    "tiderl.envs.adapters.base", "tiderl.envs.adapters.default", "tiderl.envs.adapters.gui",
    "tiderl.envs.adapters.gui_desk",
    "tiderl.agents", "tiderl.agents.chat", "tiderl.agents.toolcalls", "tiderl.agents.conversation",
    "tiderl.agents.endpoint", "tiderl.agents.runner",
    "tiderl.serving", "tiderl.serving.config", "tiderl.serving.ctb", "tiderl.serving.rank",
    "tiderl.serving.pages", "tiderl.serving.tasktable", "tiderl.serving.taskstats",
    "tiderl.serving.warmup", "tiderl.serving.ctb_usage", "tiderl.serving.taskindex",
    "tiderl.serving.taskrecords",
    "tiderl.serving.ctb_config", "tiderl.serving.valve", "tiderl.serving.preempt",
    "tiderl.serving.vanilla", "tiderl.serving.mrope", "tiderl.models.vision_inputs",
    "tiderl.serving.rollout", "tiderl.serving.rollout_window", "tiderl.serving.rollout_stats",
    "tiderl.serving.trajectory", "tiderl.serving.rank_worker",
    "tiderl.train", "tiderl.train.config", "tiderl.train.dispatch", "tiderl.train.ra2p",
    "tiderl.train.advantages", "tiderl.train.image_window", "tiderl.models.rope_index",
    "tiderl.runtime.world", "tiderl.runtime.channel", "tiderl.runtime.cells", "tiderl.runtime.wire", "tiderl.runtime.remote_rank",
    "tiderl.runtime.localworld", "tiderl.runtime.supervise", "tiderl.control.promserve",
]


def existing(names):
    out = []
    for n in names:
        try:
            if importlib.util.find_spec(n) is not None:
                out.append(n)
        except ModuleNotFoundError:
            pass
    return out


def test_control_plane_imports_without_jax():
    mods = existing(NO_JAX)
    assert "tiderl.config" in mods and "tiderl.models.tokenizer" in mods
    code = (
        "import sys, importlib\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in ('jax', 'flax', 'optax', 'orbax', 'jaxlib') if m in sys.modules)\n"
        "assert not bad, bad\n"
        "print(len(" + repr(mods) + "))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
