"""The single controller's pieces: Batch, role workers and their transfer protocols."""
from hflax.controller.batch import Batch
from hflax.controller.protocol import Protocol, transfer
from hflax.controller.training import OptimConfig, UpdateConfig
from hflax.controller.actor import ActorRolloutWorker
from hflax.controller.workers import CriticWorker, ReferenceWorker, RewardModelWorker, RoleWorker

__all__ = ["Batch", "Protocol", "transfer", "OptimConfig", "UpdateConfig", "RoleWorker",
           "ActorRolloutWorker", "ReferenceWorker", "CriticWorker", "RewardModelWorker"]
