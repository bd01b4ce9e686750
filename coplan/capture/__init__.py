"""Getting a training step into the IR: tracing real PyTorch, or building it from a spec."""
