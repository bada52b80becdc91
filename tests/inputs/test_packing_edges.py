"""Packing at its edges, found by the planted-fault pass (docs/testing.md): an image of exactly the packing
length fills a sequence of its own and is kept; one token longer is left out, as a packer defers it."""

from __future__ import annotations

import numpy as np

from mpipe_tune.inputs import Dataset
from mpipe_tune.inputs._dataset_spec import DatasetSpec, ImageRule, Records, TextRule


def test_an_image_of_exactly_the_packing_length_is_kept_and_one_token_more_is_left_out():
    records = Records.from_counts(np.array([0, 0]), np.array([1, 1]), np.array([64, 65]))
    dataset = Dataset(DatasetSpec("/x.csv", ImageRule.dynamic(), TextRule(), 64), records, "manifest")
    sequences = dataset.sequences(200, 3)
    images = {x for mb in sequences for x in mb.images}
    assert images == {64}
    assert all(mb.text_tokens == 64 and mb.image_tokens in (0, 64) for mb in sequences)
