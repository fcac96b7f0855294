"""Benchmarks and checks; run each from the repository root as ``python -m benchmarks.<name>``
(so ``train_cifar.py`` beside the package imports without path changes)."""
