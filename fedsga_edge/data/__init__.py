"""Data layer: datasets from their official layouts as uint8 NHWC image sets, and client partitions.

Importing this package needs numpy only; Pillow (resizing, image files), scikit-learn (digits)
and torchvision (CIFAR) are imported by the code that uses them.
"""

from .datasets import DATASETS, DatasetBundle, default_root, load_dataset
from .imagesets import ArrayImageSet, DatasetError, FileImageSet, ImageSet
from .local import LocalDataError, RunData, read_local_data, read_run_data, scan_local_data
from .partition import SCHEMES, partition

__all__ = [
    "DATASETS",
    "SCHEMES",
    "ArrayImageSet",
    "DatasetBundle",
    "DatasetError",
    "FileImageSet",
    "ImageSet",
    "LocalDataError",
    "RunData",
    "default_root",
    "load_dataset",
    "partition",
    "read_local_data",
    "read_run_data",
    "scan_local_data",
]
