"""`paraseek bench`: throughput, MFU, memory and weak-scaling efficiency of real `paraseek train` runs on synthetic
data, with the planner's prediction beside each measurement."""
