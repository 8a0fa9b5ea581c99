"""tiderl.agents: black-box agents through an OpenAI-compatible endpoint, and single-turn tasks
scored by a reward function. No JAX."""

from tiderl._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "AgentEndpoint": "tiderl.agents.endpoint",
    "ChatRenderer": "tiderl.agents.chat",
    "Conversation": "tiderl.agents.conversation",
    "EpisodeRunner": "tiderl.agents.runner",
    "episode_backend": "tiderl.agents.runner",
})
