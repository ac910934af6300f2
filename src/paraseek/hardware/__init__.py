"""GPUs and links: datasheet specs, NVML inventory, measurements and the doctor."""
