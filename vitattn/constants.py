"""What the models know of the data they were made for: CIFAR-10's classes and its per-channel
statistics, and the statistics timm's pretrained families normalise with, read by the presets'
``pretrained_cfg`` (timm's data config) and by the data pipeline's normalisation, without the
models importing the I/O module."""

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # per-channel, of the training images in [0, 1]
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # timm's IMAGENET_DEFAULT_MEAN (DINOv2, DeiT-III)
IMAGENET_STD = (0.229, 0.224, 0.225)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's, as timm's CLIP towers use
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
