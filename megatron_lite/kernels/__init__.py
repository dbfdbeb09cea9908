"""Attention kernels in plain PyTorch, below parallel/ and transformer/ (both use them): torch only."""
