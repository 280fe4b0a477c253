import torch

# Two cores on CI: keep intra-op threads predictable so timings and determinism hold.
torch.set_num_threads(2)
