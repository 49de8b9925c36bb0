"""The paper's numbers (Katharopoulos et al. 2020, arXiv 2006.16236 v3), in one place, for the
tasks' printed tables and the report (repro.reproduction.report) to put beside ours. Figure
values are read off the log-log plot (about ±15%); tables are as printed. Keys use this suite's
names (conf/attention, throughput methods). Each constant names the figure or table that holds
its numbers."""

# Figure 1: forward + backward of one attention layer, per sample, GTX 1080 Ti (11 GB).
# {attention: {N: (time ms, memory MB)}}; None where the paper gives no point (out of memory).
FIGURE1_HARDWARE = "NVIDIA GTX 1080 Ti 11 GB"
FIGURE1 = {
    "linear": {512: (0.6, 12), 4096: (5.0, 97), 65536: (100.0, 1500)},
    "softmax": {512: (1.4, None), 4096: (65.0, 2600)},
}
FIGURE1_SLOPES = {"linear": 1.0, "softmax": 2.0}  # time and memory against N, log-log
# The paper's softmax materialised the (N, N) matrix: our `softmax-math` is that baseline; our
# `softmax` (torch SDPA, a flash kernel with linear memory) did not exist in 2020.
FIGURE1_OURS = {"softmax": ["softmax-math", "softmax"]}
FIGURE1_PAPER_NAME = {"softmax-math": "softmax", "softmax": None}
FIGURE1_LARGEST_N = {"softmax": 4096, "lsh-4": 16384, "lsh-8": 16384, "linear": 65536}

# Figure 2: the copy task. Curves only: no numbers.
FIGURE2_CLAIM = ("linear converges smoothly to the same loss as softmax; LSH (4 rounds) ends higher "
                 "(curves only, no numbers)")
FIGURE2_SETUP = ("4 layers, 8 heads, batch 64, RAdam 1e-3 -> 1e-4 after 3000 updates; not in the paper, the "
                 "authors' copy script's defaults: d_model 256, FF 1024, 10,000 updates, LSH 64 buckets, chunk 32")

# Image generation. What the paper says about where and how: MNIST trained at batch 10; CIFAR-10
# trained 7 days per model on one P40 (batch 4, softmax 1). The batch it generated at for
# images/s is not stated.
IMAGES_SETUP = {"mnist": "8 layers, trained at batch 10",
                "cifar10": "16 layers, trained 7 days each on an NVIDIA P40 24 GB at batch 4, softmax at batch 1"}

# Table 1 (MNIST) and Table 2 (CIFAR-10): bits/dim on the test set and images/s of unconditional
# generation. {dataset: {method: (bits/dim, images/s)}}; methods as in task=throughput.
TABLES_1_2 = {"mnist": "Table 1", "cifar10": "Table 2"}
BITS_PER_DIM = {
    "mnist": {"softmax": (0.621, 0.45), "lsh-1": (0.745, 0.68), "lsh-4": (0.676, 0.27), "linear": (0.644, 142.8)},
    "cifar10": {"softmax": (3.47, 0.004), "lsh-1": (3.39, 0.015), "lsh-4": (3.51, 0.005), "linear": (3.40, 17.85)},
}

# Table 4 (supplementary): images/s for both datasets, with stateful softmax (softmax with a
# key/value cache, supplementary C.1). {dataset: {method: images/s}}
IMAGES_PER_S = {
    "mnist": {"softmax": 0.45, "stateful-softmax": 7.56, "lsh-1": 0.68, "lsh-4": 0.27, "linear": 142.8},
    "cifar10": {"softmax": 0.004, "stateful-softmax": 0.32, "lsh-1": 0.015, "lsh-4": 0.005, "linear": 17.85},
}

# Table 5 (supplementary): seconds to generate one image, CPU and GPU, both datasets.
# {dataset: {method: (CPU s, GPU s)}}
SECONDS_PER_IMAGE = {
    "mnist": {"softmax": (72.6, 10.2), "stateful-softmax": (7.4, 10.4), "lsh-1": (46.0, 19.2),
              "lsh-4": (112.0, 55.8), "linear": (5.5, 7.3)},
    "cifar10": {"softmax": (8651.4, 300.1), "stateful-softmax": (71.9, 70.4), "lsh-1": (2318.9, 221.6),
                "lsh-4": (5263.7, 683.9), "linear": (45.1, 61.3)},
}

# Table 3: WSJ speech recognition, CTC over phonemes: validation PER % and seconds per epoch.
ASR_HARDWARE = "1 GPU (not named in the paper)"
ASR = {"bilstm": (10.94, 1047), "softmax": (5.12, 2711), "lsh-4": (9.33, 2250), "linear": (8.08, 824)}


# The tasks name CIFAR-10 `cifar` (conf/task/cifar.yaml); the tables above name it `cifar10`.
DATASETS = {"mnist": "mnist", "cifar": "cifar10", "cifar10": "cifar10"}


def paper_bits_per_dim(dataset: str, method: str) -> float:
    """Tables 1 and 2: the paper's test bits/dim of `method` on `dataset` (NaN where it has none)."""
    return BITS_PER_DIM.get(DATASETS.get(dataset, dataset), {}).get(method, (float("nan"), None))[0]


def paper_cpu_seconds_per_image(dataset: str, method: str) -> float | None:
    """Table 5: the paper's CPU seconds to generate one image at batch 1 (None where it has none)."""
    return SECONDS_PER_IMAGE.get(DATASETS.get(dataset, dataset), {}).get(method, (None, None))[0]
