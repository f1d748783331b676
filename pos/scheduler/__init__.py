"""The checkpoint/restore engines: CRIU for the CPU side, the CUDA driver's checkpoint API for
the GPU side, the image format, the watchdog that undoes a half-done operation, migration."""
