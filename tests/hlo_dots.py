"""What the matmuls of a compiled XLA program read, from its optimized HLO text."""
import re


def dot_operand_types(hlo_text):
  """The element types of each dot's two operands (instruction names are module-unique)."""
  types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo_text))
  return [tuple(types[name] for name in re.findall(r"%([\w.\-]+)", operands))
          for operands in re.findall(r" dot\(([^)]*)\)", hlo_text)]
