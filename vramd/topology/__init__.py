"""KFD topology: the machine's GPUs (model), read from sysfs (sysfs), and checkpoint GPUs mapped onto them
at restore by CRIU's rules (search, mapping).  docs/topology.md describes the rules."""
from ..errors import TopologyError, TopologyMismatchError
from .mapping import map_gpus
from .model import Cpu, Gpu, IoLink, Node, SkippedNode, Topology
from .search import CHECK_ENV, Checks, compare_gpus
from .sysfs import DEFAULT_ROOT, parse_properties, parse_topology, render_node

__all__ = ["CHECK_ENV", "DEFAULT_ROOT", "Checks", "Cpu", "Gpu", "IoLink", "Node", "SkippedNode", "Topology",
           "TopologyError", "TopologyMismatchError", "compare_gpus", "map_gpus", "parse_properties",
           "parse_topology", "render_node"]
