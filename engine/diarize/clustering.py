"""One recording's window embeddings -> a speaker label per window.

senko's spectral clustering (3D-Speaker's, adapted from SpeechBrain) with senko's tuned settings:
cosine affinities pruned to each row's nearest neighbours, the number of speakers read from the
largest gap among the Laplacian's smallest eigenvalues, k-means on the eigenvectors, clusters
smaller than a few windows folded into their nearest, and clusters whose centroids are nearly
parallel merged. ``min_speakers``/``max_speakers`` bound the eigen-gap search (equal bounds fix the
count); with a lower bound the near-parallel merge is skipped, since the caller has said there are
at least that many voices. senko's UMAP + HDBSCAN path for recordings over 20 minutes is not used:
spectral clustering of a few thousand windows stays cheap, and UMAP's numba compilation would add
minutes to start-up.
"""

from __future__ import annotations

import functools

import numpy as np
import yaml


@functools.lru_cache(maxsize=1)
def _spectral_settings() -> dict:
    from senko import config

    with open(config.SPECTRAL_YAML) as settings:
        return dict(yaml.safe_load(settings)["cluster"]["args"])


def cluster_speakers(
    embeddings: np.ndarray, min_speakers: int | None = None, max_speakers: int | None = None
) -> np.ndarray:
    """[n, dim] embeddings -> [n] labels, numbered 0.. in the order each speaker first appears."""
    from senko.cluster.cluster_cpu import CommonClustering

    if len(embeddings) == 0:
        return np.zeros(0, dtype=np.int64)
    settings = dict(_spectral_settings())
    lowest = min_speakers or settings["min_num_spks"]
    # The eigen-gap search reads one eigenvalue past the largest count it may pick.
    highest = min(max_speakers or settings["max_num_spks"], max(len(embeddings) - 2, 1))
    lowest = min(lowest, highest)
    settings.update(
        min_num_spks=lowest,
        max_num_spks=highest,
        oracle_num=lowest if lowest == highest and min_speakers else None,
        mer_cos=None if min_speakers else settings["mer_cos"],
    )
    # senko's clustering changes the affinity matrix it builds, never the input; copy anyway so a
    # caller's array is never touched.
    labels = CommonClustering(**settings)(np.array(embeddings, dtype=np.float32))
    return _by_first_appearance(labels)


def _by_first_appearance(labels: np.ndarray) -> np.ndarray:
    order: dict[int, int] = {}
    for label in labels:
        order.setdefault(int(label), len(order))
    return np.array([order[int(label)] for label in labels], dtype=np.int64)
