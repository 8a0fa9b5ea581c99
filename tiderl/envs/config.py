"""Environment-side config (JAX-free)."""

from __future__ import annotations

import dataclasses
import re
import secrets
from typing import Literal

from tiderl.configlib import LOOPBACK, ConfigError

SUITES = ("default", "gym", "textworld", "textarena", "gui")
DEFAULT_MAX_ACTION_CHARS = 4096
"""env.max_action_chars of a server with none derived (the least a run derives)."""
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_spec(value: str) -> bool:
    """`package.module:attr`, the form user code is named by (env.suite, env.reward, env.agent)."""
    return bool(_SPEC.match(value))


def check_spec(key: str, value: str, what: str) -> None:
    if value and not is_spec(value):
        raise ConfigError(f"config key '{key}'={value!r} is not 'package.module:name'; name "
                          f"{what} as e.g. {key}=my_pkg.my_module:my_name")


def _positive(section: str, name: str, value: float, fix: str = "") -> None:
    if value <= 0:
        raise ConfigError(f"config key '{section}.{name}' must be positive, got {value!r}"
                          + (f"; {fix}" if fix else ""))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatencyConfig:
    """Injected per-step environment latency (server side), seeded per task and turn."""

    dist: Literal["none", "lognormal", "pareto"] = "none"
    """'lognormal' (median, sigma) or 'pareto' (scale, alpha); 'none' adds nothing."""
    median_s: float = 0.05
    """Lognormal median (exp(mu)) in seconds."""
    sigma: float = 0.5
    """Lognormal shape (std of log latency)."""
    scale_s: float = 0.02
    """Pareto minimum x_m in seconds."""
    alpha: float = 2.0
    """Pareto tail index (> 1 for a finite mean)."""
    start_factor: float = 1.0
    """Multiplier for /start (reset is often slower than a step, e.g. TextWorld compiles)."""
    cap_s: float = 30.0
    """Upper clip of one sample, so a heavy tail cannot stall a test or a run."""
    seed: int = 0
    """Mixed with each task's id and turn: the same task sees the same delays."""

    def __post_init__(self):
        for name in ("median_s", "sigma", "scale_s", "alpha", "cap_s"):
            _positive("env.latency", name, getattr(self, name))
        if self.start_factor < 0:
            raise ConfigError(f"config key 'env.latency.start_factor' must be >= 0, got "
                              f"{self.start_factor}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageConfig:
    """Limits on the images an observation, a /start task, an action or an agent's chat request
    carries (PNG or JPEG); one over a limit is refused naming the key (4xx from a server or the
    endpoint, env_error from the client)."""

    max_images: int = 16
    """Images in one observation, task, action or chat request."""
    max_bytes: int = 4 << 20
    """Encoded size of one image (before base64)."""
    max_total_bytes: int = 16 << 20
    """Encoded size of all images of one observation or request together. A request's JSON body
    is also bounded by env.max_request_bytes (env server) or env.endpoint.max_request_bytes."""
    max_side: int = 4096
    """Largest width and height of one image, in pixels."""
    max_pixels: int = 3840 * 2160
    """Largest width × height of one image (4K by default; the paper's screenshots are
    1280×720)."""

    def __post_init__(self):
        for name in ("max_images", "max_bytes", "max_total_bytes", "max_side", "max_pixels"):
            _positive("env.images", name, getattr(self, name))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EndpointConfig:
    """The OpenAI-compatible endpoint a run serves to black-box agents (env.agent)."""

    host: str = "127.0.0.1"
    """Bind address; loopback unless you mean to expose it (then env.endpoint.token is
    required)."""
    port: int = 0
    """Port; 0 picks a free one (logged, and in each agent's base_url)."""
    token: str = ""
    """Bearer token every request must carry (the agent's api_key); '' for none (loopback
    only)."""
    request_timeout_s: float = 600.0
    """How long one chat request may wait for its turn (scheduling included); then 504."""
    idle_timeout_s: float = 600.0
    """An agent that sends nothing for this long while its task is open ends it (timeout)."""
    tool_parser: Literal["auto", "hermes", "llama3", "none"] = "auto"
    """How tool calls are read from the model's output: 'hermes' (<tool_call>{json}</tool_call>,
    Qwen/Hermes), 'llama3' ({"name", "parameters"} JSON), 'none', or 'auto' (from the chat
    template)."""
    max_request_bytes: int = 8 << 20
    """Largest request body; larger ones answer 413."""
    model_name: str = "tiderl"
    """The model id /v1/models lists and responses carry (any requested model is accepted)."""

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ConfigError(f"config key 'env.endpoint.port' must be in 0..65535, got "
                              f"{self.port}")
        for name in ("request_timeout_s", "idle_timeout_s", "max_request_bytes"):
            _positive("env.endpoint", name, getattr(self, name))
        if self.host not in LOOPBACK and not self.token:
            raise ConfigError(f"config key 'env.endpoint.host'={self.host!r} exposes the agent "
                              "endpoint beyond this machine; set env.endpoint.token (agents send "
                              "it as their api_key) or bind to 127.0.0.1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """Which tasks the run plays, against which environment, scored how."""

    suite: str = ""
    """Adapter served by the env server: a built-in suite ('default', 'gym', 'textworld',
    'textarena', 'gui') or your own `package.module:Class` (an Adapter subclass). '' means the
    default task, or — when env.tasks and env.reward are set and env.agent is not — single-turn tasks
    with no env server."""
    tasks: str = ""
    """Task file of the train split: .jsonl, .parquet, or a saved Hugging Face `datasets`
    folder; each row (one GRPO group) reaches the environment as the task payload. '' draws
    tasks from the suite's seeds."""
    eval_tasks: str = ""
    """Task file of the eval split (first env.eval_groups rows); '' with env.tasks set: no
    evaluation."""
    shuffle: bool = True
    """Shuffle the train split, anew each epoch (seeded by env.task_seed)."""
    epochs: int = 0
    """Passes over the train split (0: until the run ends); the run ends when they are used."""
    reward: str = ""
    """`package.module:function` scoring each task, `(task, transcript) -> float | dict`
    (sync or async); '' uses the environment's own reward."""
    reward_timeout_s: float = 60.0
    """Longest one reward call may take; then the task fails (reward_error)."""
    agent: str = ""
    """`package.module:function` called per task as `(task, base_url, api_key)`: your agent,
    talking to the run's OpenAI-compatible endpoint at base_url; '' for none."""
    endpoint: EndpointConfig = dataclasses.field(default_factory=EndpointConfig)
    """Where the endpoint for env.agent listens."""
    url: str = ""
    """Base URL of a running env server; '' starts one in-process on 127.0.0.1 (port 0)."""
    token: str = ""
    """Bearer token sent to (and, in-process, required by) the env server; '' for none."""
    concurrency: int = 64
    """Max concurrent env sessions (requests in flight) from this job."""

    # -- client --
    connect_timeout_s: float = 5.0
    """TCP connect timeout of one HTTP attempt."""
    request_timeout_s: float = 60.0
    """Total time of one HTTP attempt (connect + server work + reply)."""
    call_deadline_s: float = 180.0
    """Cap on one client call including all retries and backoff; then timeout/env_error."""
    retries: int = 3
    """Extra attempts after the first on connection errors, timeouts, 429, 502, 503."""
    backoff_s: float = 0.2
    """First retry delay; doubles each retry (with jitter) up to backoff_max_s."""
    backoff_max_s: float = 5.0
    """Largest single retry delay."""

    # -- server --
    host: str = "127.0.0.1"
    """Address the env server binds; loopback unless you mean to expose it."""
    port: int = 0
    """Port the env server binds; 0 picks a free one."""
    max_sessions: int = 4096
    """Live (active or paused) sessions the server holds; /start beyond it answers 429."""
    idle_timeout_s: float = 300.0
    """A session with no request for this long is reaped; the clock stops while paused."""
    max_pause_s: float = 86400.0
    """A paused session is reaped after this long paused (guards against a dead controller)."""
    max_request_bytes: int = 1 << 20
    """Largest request body the server reads; larger ones answer 413."""
    max_action_chars: int = 0
    """Longest action string accepted by /observation; longer ones answer 413 and end that task
    action_too_long (it still trains). 0: derived — in a run, room for rollout.max_action_tokens
    tokens of the run's tokenizer (each at most its longest token's characters: 1 for the byte
    tokenizer), at least 4096; a server started on its own takes 4096. A run checks that a value
    it sets for its in-process server holds a whole action."""
    max_turns: int = 256
    """Turn limit of an episode: the run's episode runner ends a task after this many actions
    (end reason turn_limit), and the env server (in-process or `python -m tiderl.envs serve`)
    reports done after this many /observation calls."""
    latency: LatencyConfig = dataclasses.field(default_factory=LatencyConfig)
    """Injected per-step latency, to mimic slow environments (WebShop, ALFWorld)."""
    images: ImageConfig = dataclasses.field(default_factory=ImageConfig)
    """Limits on images in observations, tasks, actions and agents' chat requests."""
    image_window: int = 10
    """Sliding image window of a vision-language policy's tasks (arXiv 2608.10402): once a
    context holds this many images it is cut before the next observation; the cut part trains
    as a segment with the trajectory's advantage and the task continues from its
    env.image_keep most recent images (recomputed). 0: never cut."""
    image_keep: int = 5
    """Most recent images a cut context continues with (below env.image_window)."""

    # -- tasks --
    group_size: int = 8
    """Tasks per group (GRPO siblings sharing one env seed)."""
    train_groups: int = 100_000
    """Distinct groups in the train split (the stream repeats it epoch after epoch)."""
    eval_groups: int = 64
    """Distinct groups in the eval split (disjoint seeds from train); each evaluation runs all
    of them."""
    task_seed: int = 0
    """Base of the suite-specific seeds and of the stream's shuffle."""
    options: tuple[str, ...] = ()
    """Suite options as 'key=value' strings, e.g. ('n=8', 'guesses=3') or ('game=Taxi-v4')."""

    def __post_init__(self):
        if self.suite and self.suite not in SUITES and not is_spec(self.suite):
            raise ConfigError(f"config key 'env.suite': {self.suite!r} is not a known suite; "
                              f"set env.suite to one of {', '.join(SUITES)} or to your adapter "
                              "as package.module:Class")
        check_spec("env.reward", self.reward, "your reward function")
        check_spec("env.agent", self.agent, "your agent function")
        if self.agent and (self.suite or self.url):
            raise ConfigError("config key 'env.agent' is set together with env.suite/env.url: an "
                              "agent task runs against the agent endpoint, not an env server; "
                              "unset env.suite and env.url")
        if self.tasks and not (self.suite or self.reward or self.agent):
            raise ConfigError(f"config key 'env.tasks'={self.tasks!r} needs a way to play its "
                              "rows: env.suite (your adapter, or a built-in suite), env.reward "
                              "(single-turn rows with 'prompt' or 'messages') or env.agent")
        if self.eval_tasks and not self.tasks:
            raise ConfigError("config key 'env.eval_tasks' is set without env.tasks; set "
                              "env.tasks (the train split) too")
        if self.epochs < 0:
            raise ConfigError(f"config key 'env.epochs' must be >= 0 (0: no limit), got "
                              f"{self.epochs}")
        _positive("env", "reward_timeout_s", self.reward_timeout_s)
        if self.concurrency <= 0:
            raise ConfigError(f"config key 'env.concurrency' must be positive, got "
                              f"{self.concurrency}")
        for name in ("connect_timeout_s", "request_timeout_s", "call_deadline_s", "backoff_s",
                     "backoff_max_s", "idle_timeout_s", "max_pause_s"):
            _positive("env", name, getattr(self, name))
        for name in ("max_sessions", "max_request_bytes", "max_turns",
                     "group_size", "train_groups", "eval_groups"):
            _positive("env", name, getattr(self, name))
        if self.max_action_chars < 0:
            raise ConfigError(f"config key 'env.max_action_chars' must be >= 0 (0: derived from "
                              f"rollout.max_action_tokens), got {self.max_action_chars}")
        if self.retries < 0:
            raise ConfigError(f"config key 'env.retries' must be >= 0, got {self.retries}")
        if self.image_window < 0 or self.image_window and not 0 < self.image_keep < \
                self.image_window:
            raise ConfigError(f"config keys 'env.image_window'={self.image_window} and "
                              f"'env.image_keep'={self.image_keep}: the window must be >= 0 "
                              "(0: never cut) and the kept images between 1 and the window - 1")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"config key 'env.port' must be in 0..65535, got {self.port}")
        if self.call_deadline_s < self.request_timeout_s:
            raise ConfigError(
                f"config key 'env.call_deadline_s'={self.call_deadline_s} is below "
                f"env.request_timeout_s={self.request_timeout_s}; raise env.call_deadline_s")
        for opt in self.options:
            if "=" not in opt or not opt.split("=", 1)[0].strip():
                raise ConfigError(f"config key 'env.options': {opt!r} is not 'key=value'; "
                                  "write e.g. env.options=[n=8,guesses=3]")

    @property
    def kind(self) -> Literal["env", "single_turn", "agent"]:
        """How tasks run: against an env server, as one completion scored by env.reward, or by
        the user's agent through the endpoint."""
        if self.agent:
            return "agent"
        if not self.suite and self.tasks and self.reward:
            return "single_turn"
        return "env"

    @property
    def suite_name(self) -> str:
        """The adapter suite an env task uses ('' resolves to the default task)."""
        return self.suite or "default"

    @property
    def action_chars(self) -> int:
        """The action length limit a server enforces (`max_action_chars`, or its default)."""
        return self.max_action_chars or DEFAULT_MAX_ACTION_CHARS

    def option_dict(self) -> dict[str, str]:
        """`options` as a dict of strings (suites parse their own values)."""
        return {k.strip(): v.strip() for k, v in (o.split("=", 1) for o in self.options)}




def with_default_token(cfg: EnvConfig) -> tuple[EnvConfig, bool]:
    """A server bound beyond loopback never runs open: an in-process or CLI env server with no
    `env.token` gets a generated one (returned, and True) that its clients must send."""
    if cfg.token or cfg.url or cfg.host in LOOPBACK:
        return cfg, False
    return dataclasses.replace(cfg, token=secrets.token_urlsafe(24)), True
