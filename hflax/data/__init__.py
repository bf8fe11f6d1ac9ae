"""Prompt data: verl-schema rows, file loaders, the built-in arithmetic task, batching."""
from hflax.data.arithmetic import arithmetic_task
from hflax.data.files import load_prompts, save_prompts
from hflax.data.loader import PromptLoader
from hflax.data.schema import PromptDataset, normalize_row

__all__ = ["PromptDataset", "normalize_row", "load_prompts", "save_prompts", "arithmetic_task",
           "PromptLoader"]
