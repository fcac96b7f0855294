"""What the models know of the data they were made for: CIFAR-10's classes and its per-channel
statistics, read by the presets' ``pretrained_cfg`` (timm's data config) and by the data
pipeline's normalisation, without the models importing the I/O module."""

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # per-channel, of the training images in [0, 1]
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
