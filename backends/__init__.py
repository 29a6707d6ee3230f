"""Device backends, one folder per device family, each with the same files:
renderer, compiler, runtime, allocator, device. Installed as `morok_py.backends`."""
