"""Multi-turn agents on the rollout engine: environments, tools, the agent loop."""
from hflax.rollout.agents.chat import MessageDelta
from hflax.rollout.agents.environment import Environment, Observation, ToolEnvironment, Turn
from hflax.rollout.agents.loop import AgentLoop, Trajectory, to_batch_fields
from hflax.rollout.agents.tools import (FunctionTool, HermesParser, ParsedTurn, Tool, ToolCall,
                                        tools_system_prompt)

__all__ = ["AgentLoop", "Environment", "FunctionTool", "HermesParser", "MessageDelta",
           "Observation", "ParsedTurn", "Tool", "ToolCall", "ToolEnvironment", "Trajectory",
           "Turn", "to_batch_fields", "tools_system_prompt"]
