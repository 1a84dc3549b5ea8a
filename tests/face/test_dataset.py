"""EntryDataset: items equal entry.array rows on every access path, targets follow rows,
the pickle stays small, a corrupt entry fails clearly inside workers, and a removed one is
read on wherever its files were kept open."""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Subset, WeightedRandomSampler

import cachekit
from cachekit import arrays
from cachekit.store import manifest as manifests
from cachekit.obtain import obtain, staleness
from cachekit.obtain.built import Built
from cachekit.store import LocalStore
from cachekit.dataset import DatasetCorruptError, EntryDataset
from helpers import FunctionRequest

ROWS = 300
DATA = np.random.default_rng(4).integers(0, 256, size=(ROWS, 3, 4, 5), dtype=np.uint8)
# A hang in a worker becomes an error after this many seconds instead of a stuck test run.
WORKER_TIMEOUT = 120


def data_row(i: int) -> np.ndarray:
    return DATA[i]


def data_entry(root: Path) -> cachekit.Entry:
    return cachekit.Cache(root, progress=False).map(data_row, pd.Series(range(ROWS)))


@pytest.fixture(scope="module")
def shared_entry(tmp_path_factory) -> cachekit.Entry:
    """One read-only entry for the tests that do not damage it."""
    return data_entry(tmp_path_factory.mktemp("dataset") / "cache")


@pytest.fixture
def own_entry(cache_root) -> cachekit.Entry:
    """A private entry, for the tests that truncate or remove it."""
    return data_entry(cache_root)


def loader(dataset, **options) -> DataLoader:
    if options.get("num_workers", 0) > 0:
        options.setdefault("timeout", WORKER_TIMEOUT)
    return DataLoader(dataset, batch_size=options.pop("batch_size", 32), **options)


def assert_batches_match(entry, batches) -> np.ndarray:
    """Every (x, y) batch holds rows y of entry.array; return all ys in the order seen."""
    seen = []
    for x, y in batches:
        assert x.dtype == torch.uint8 and x.shape[1:] == entry.array.shape[1:]
        np.testing.assert_array_equal(x.numpy(), entry.array[y.numpy()])
        seen.append(y.numpy())
    return np.concatenate(seen)


def test_item_is_an_owned_uint8_copy_of_the_row(shared_entry):
    dataset = shared_entry.dataset()
    assert isinstance(dataset, EntryDataset) and len(dataset) == ROWS
    for i in (0, 1, 157, ROWS - 1, -1, np.int64(7), torch.tensor(8)):
        item = dataset[i]
        assert item.dtype == torch.uint8 and item.shape == (3, 4, 5)
        np.testing.assert_array_equal(item.numpy(), shared_entry.array[int(i)])
    item = dataset[3]
    item.fill_(0)  # writable, and writing it changes neither the cache nor the next read
    np.testing.assert_array_equal(dataset[3].numpy(), DATA[3])
    with pytest.raises(IndexError):
        dataset[ROWS]
    with pytest.raises(TypeError):
        dataset[1.5]


def test_getitems_returns_rows_in_the_requested_order(shared_entry):
    dataset = shared_entry.dataset()
    wanted = [299, 5, 2, 2, 0, -1, 150]
    items = dataset.__getitems__(wanted)
    assert len(items) == len(wanted)
    for item, i in zip(items, wanted):
        assert item.dtype == torch.uint8
        np.testing.assert_array_equal(item.numpy(), shared_entry.array[i])
    items[2].fill_(0)  # a duplicate index gets its own copy
    np.testing.assert_array_equal(items[3].numpy(), DATA[2])
    assert dataset.__getitems__([]) == []
    with pytest.raises(IndexError, match=f"{ROWS}"):
        dataset.__getitems__([1, ROWS])


def test_images_entry_items_are_chw_uint8(cache_root, cover_paths):
    entry = cachekit.Cache(cache_root, progress=False).images(pd.Series(cover_paths), (8, 6))
    dataset = entry.dataset()
    assert dataset[0].shape == (3, 8, 6) and dataset[0].dtype == torch.uint8
    for i, item in enumerate(dataset.__getitems__(list(range(len(entry))))):
        np.testing.assert_array_equal(item.numpy(), entry.array[i])


def test_other_entries_give_the_row_as_a_tensor(cache_root):
    cache = cachekit.Cache(cache_root, progress=False)
    vectors = cache.map(lambda v: np.full(4, v / 2, dtype=np.float32), pd.Series(range(10)))
    assert torch.equal(vectors.dataset()[3], torch.full((4,), 1.5))
    scalars = cache.map(lambda v: torch.tensor(v * 3, dtype=torch.int16), pd.Series(range(10)))
    items = scalars.dataset().__getitems__([4, 1])
    assert [item.item() for item in items] == [12, 3] and items[0].dtype == torch.int16
    assert scalars.dataset()[9].shape == ()


@pytest.mark.parametrize("kind", ["list", "numpy", "series", "tensor", "strings"])
def test_targets_follow_rows(shared_entry, kind):
    labels = np.arange(ROWS) * 7 % 10
    targets = {
        "list": labels.tolist(),
        "numpy": labels,
        # a shuffled index: targets are taken by position, never by label
        "series": pd.Series(labels, index=np.random.default_rng(0).permutation(ROWS)),
        "tensor": torch.from_numpy(labels),
        "strings": [f"class-{label}" for label in labels],
    }[kind]
    dataset = shared_entry.dataset(targets=targets)
    for i in (0, 13, ROWS - 1):
        x, y = dataset[i]
        np.testing.assert_array_equal(x.numpy(), DATA[i])
        assert (y == f"class-{labels[i]}") if kind == "strings" else int(y) == labels[i]
    wanted = [17, 4, 250, 4]
    for (x, y), i in zip(dataset.__getitems__(wanted), wanted):
        np.testing.assert_array_equal(x.numpy(), DATA[i])
        assert (y == f"class-{labels[i]}") if kind == "strings" else int(y) == labels[i]


def test_targets_of_the_wrong_length_or_type_are_refused(shared_entry):
    with pytest.raises(ValueError, match=f"targets has {ROWS - 1} items .* {ROWS} rows"):
        shared_entry.dataset(targets=np.zeros(ROWS - 1))
    with pytest.raises(ValueError, match=f"{ROWS + 1} items .* {ROWS} rows"):
        shared_entry.dataset(targets=torch.zeros(ROWS + 1))
    with pytest.raises(ValueError):
        shared_entry.dataset(targets=torch.tensor(3))
    with pytest.raises(TypeError, match="targets"):
        shared_entry.dataset(targets="labels")
    with pytest.raises(TypeError, match="transform"):
        shared_entry.dataset(transform="scale")


def test_v2_transform_reproduces_to_tensor_scaling(shared_entry):
    from PIL import Image
    from torchvision.transforms import ToTensor, v2

    dataset = shared_entry.dataset(targets=np.arange(ROWS),
                                   transform=v2.ToDtype(torch.float32, scale=True))
    x, y = dataset[5]
    assert x.dtype == torch.float32 and int(y) == 5
    seed = ToTensor()(Image.fromarray(DATA[5].transpose(1, 2, 0)))  # the seed's scaling
    torch.testing.assert_close(x, seed, rtol=0, atol=1e-7)  # x * (1/255) vs x / 255: 1 ulp
    (x, y), = dataset.__getitems__([9])
    torch.testing.assert_close(x, torch.from_numpy(DATA[9]).float() / 255, rtol=0, atol=1e-7)


def test_dataloader_in_process_with_shuffle_and_subset(shared_entry):
    dataset = shared_entry.dataset(targets=np.arange(ROWS))
    seen = assert_batches_match(shared_entry, loader(dataset, shuffle=True))
    assert sorted(seen) == list(range(ROWS)) and list(seen) != list(range(ROWS))
    valid_rows = np.flatnonzero(shared_entry.valid)[::3]
    subset = Subset(dataset, valid_rows.tolist())  # Subset forwards __getitems__
    seen = assert_batches_match(shared_entry, loader(subset, shuffle=True))
    assert sorted(seen) == valid_rows.tolist()


def test_forked_persistent_workers_reshuffle_each_epoch(shared_entry):
    dataset = shared_entry.dataset(targets=np.arange(ROWS))
    dataset[0]  # mapped in this process first: the forked workers must map their own
    batches = loader(dataset, shuffle=True, num_workers=2, persistent_workers=True,
                     multiprocessing_context="fork")
    first = assert_batches_match(shared_entry, batches)
    second = assert_batches_match(shared_entry, batches)
    assert sorted(first) == sorted(second) == list(range(ROWS))
    assert list(first) != list(second)


def test_weighted_sampler_with_workers(shared_entry):
    weights = np.where(np.arange(ROWS) % 2 == 0, 1.0, 0.0)  # only even rows can be drawn
    sampler = WeightedRandomSampler(weights.tolist(), num_samples=500, replacement=True)
    dataset = shared_entry.dataset(targets=torch.arange(ROWS))
    seen = assert_batches_match(shared_entry, loader(dataset, sampler=sampler, num_workers=2,
                                                     multiprocessing_context="fork"))
    assert len(seen) == 500 and (seen % 2 == 0).all() and len(set(seen)) < 500


def test_pin_memory_does_not_fail(shared_entry):
    dataset = shared_entry.dataset(targets=np.arange(ROWS))
    batches = loader(dataset, shuffle=True, pin_memory=True)
    with warnings.catch_warnings():  # torch 2.14 warns that nothing can pin here (2.1 not)
        warnings.filterwarnings("ignore", ".*pin_memory", UserWarning)
        started = iter(batches)
    assert sorted(assert_batches_match(shared_entry, started)) == list(range(ROWS))


def test_spawned_workers_map_the_entry_themselves(shared_entry):
    dataset = shared_entry.dataset(targets=torch.arange(ROWS) + 1000)
    batches = loader(dataset, batch_size=64, shuffle=True, num_workers=2,
                     multiprocessing_context="spawn")
    seen = []
    for x, y in batches:
        np.testing.assert_array_equal(x.numpy(), DATA[y.numpy() - 1000])
        seen.extend(y.tolist())
    assert sorted(seen) == list(range(1000, 1000 + ROWS))


def test_pickle_is_small_whatever_the_rows(cache_root):
    rows = 100_000

    def build_zeros(current, on_chunk) -> Built:
        arrays.create_array(current.dir, manifests.DATA_FILE, (rows, 3, 8, 8),
                            np.dtype(np.uint8))
        return Built(kind="map", rows=rows, files=((manifests.DATA_FILE, "numpy"),))

    outcome = obtain(LocalStore(cache_root), FunctionRequest("0" * 32, build_zeros),
                     lock_timeout=None)
    entry = cachekit.Entry(outcome.entry.path, outcome.entry.manifest, source="local")
    dataset = entry.dataset()
    dataset[rows - 1]  # once mapped, the mapping still is not pickled
    blob = pickle.dumps(dataset)
    assert len(blob) < 16 * 1024, len(blob)
    clone = pickle.loads(blob)
    assert len(clone) == rows and clone[rows - 1].shape == (3, 8, 8)
    assert clone.entry.key == entry.key and clone.entry.path == entry.path
    entry_blob = pickle.dumps(entry)
    assert len(entry_blob) < 16 * 1024, len(entry_blob)
    entry_clone = pickle.loads(entry_blob)
    assert entry_clone.array.shape == (rows, 3, 8, 8) and entry_clone.valid.all()


def test_entry_pickle_keeps_invalid_rows(cache_root):
    entry = cachekit.Cache(cache_root, progress=False).images(
        pd.Series(["/nonexistent/a.jpg", "/nonexistent/b.jpg"]), 4, on_error="zero")
    clone = pickle.loads(pickle.dumps(entry))
    assert clone.valid.tolist() == [False, False] and clone.hit == entry.hit
    np.testing.assert_array_equal(np.asarray(clone.array), np.asarray(entry.array))
    with pytest.raises(AttributeError, match="nothing"):
        clone.nothing


def test_an_entry_sent_pickled_and_opened_after_a_clear_says_it_was_removed(cache_root):
    """A Dask task receives an Entry by plain pickle and opens it by its path: removed
    since, it is not corrupt, and `cachekit clear KEY` (what a corrupt one says to run)
    would find nothing. The error says so, and pickles back (from a worker) the same."""
    entry = cachekit.Cache(cache_root, progress=False).images(
        pd.Series(["/nonexistent/a.jpg"]), 4, on_error="zero")
    blob = pickle.dumps(entry)
    cachekit.Cache(cache_root).clear()
    with pytest.raises(cachekit.CacheCorruptError) as caught:
        pickle.loads(blob).array
    error = pickle.loads(pickle.dumps(caught.value))
    assert error.removed and str(error).startswith(f"removed cache entry {entry.path}: ")
    assert "call cache.images (or map) again" in str(error) and "clear" not in error.fix


def first_batch_error(batches: DataLoader) -> BaseException:
    """The exception that reading the first batch raises (the test fails without one)."""
    iterator = iter(batches)
    try:
        next(iterator)
    except Exception as e:
        return e
    finally:
        # torch's re-raise leaves a reference cycle through the traceback, so gc would shut
        # the iterator down later, when its queues may be closed already: then each worker
        # join times out after 5 s (MP_STATUS_CHECK_INTERVAL). Shut it down now instead.
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
    pytest.fail("reading the first batch raised nothing")


def truncate(entry: cachekit.Entry) -> Path:
    data = entry.path / manifests.DATA_FILE
    os.truncate(data, data.stat().st_size - 10)
    return data


@pytest.mark.parametrize("workers", [0, 2])
def test_truncated_entry_fails_clearly_in_the_reader(own_entry, workers):
    dataset = own_entry.dataset(targets=np.arange(ROWS))
    data = truncate(own_entry)
    batches = loader(dataset, shuffle=True, num_workers=workers, multiprocessing_context=(
        "fork" if workers else None))
    error = first_batch_error(batches)
    assert isinstance(error, cachekit.CacheCorruptError), repr(error)
    assert str(data) in str(error) and "expected" in str(error) and error.path == str(data)
    if workers:
        assert "DataLoader worker" in str(error)  # raised there, re-raised here


def says_removed(error: BaseException) -> None:
    """The message of a Dataset whose entry was removed: what happened and what to do, not
    the corrupt entry's advice to remove it (it is gone already)."""
    message = str(error)
    assert "removed cache entry " in message and "corrupt" not in message, message
    assert "was removed (`cachekit clear`, `prune` or a cache budget) after this Dataset was " \
        "made" in message
    assert "nothing left to remove; call cache.images (or map, memoize) again" in message
    assert "cachekit clear KEY" not in message, message


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_started_workers_read_what_the_entry_read_after_it_was_removed_and_built_again(
        tmp_path, cover_paths, context):
    """A worker that spawn or forkserver starts (Python 3.14's default) receives the files
    its parent's Entry keeps open: after `clear` removed the entry, and after the key was
    built again from changed images, it reads the rows its parent read, of a contiguous
    entry and of a derived one."""
    cache = cachekit.Cache(tmp_path / "root", progress=False, executor="threads")
    paths = pd.Series(cover_paths)
    full = cache.images(paths, 8)
    fold = cache.images(paths.iloc[2:9], 8)
    assert full.contiguous and not fold.contiguous
    read = {entry.key: np.array(entry.array) for entry in (full, fold)}
    datasets = [entry.dataset(targets=np.arange(len(entry))) for entry in (full, fold)]
    cache.clear()
    staleness.wait_for_checks()  # the fold's check of its shared rows, before they change
    for path in cover_paths:  # other pixels under the same names: the same keys
        Image.open(path).transpose(Image.Transpose.ROTATE_180).save(path)
    again = cache.images(paths, 8)
    assert again.key == full.key and not np.array_equal(np.asarray(again.array), read[full.key])
    for dataset in datasets:
        batches = loader(dataset, batch_size=3, num_workers=1, multiprocessing_context=context)
        rows = read[dataset.entry.key]
        seen = []
        for x, y in batches:
            np.testing.assert_array_equal(x.numpy(), rows[y.numpy()])
            seen += y.tolist()
        assert sorted(seen) == list(range(len(rows)))


def test_a_pickle_for_anything_but_a_starting_worker_carries_no_descriptor(own_entry):
    """Only a child that multiprocessing starts receives the open files: a pickle for
    anywhere else (a Dask task) is the location, opened by path where it is read."""
    clone = pickle.loads(pickle.dumps(own_entry))
    assert clone.__dict__.get("_files") is None
    np.testing.assert_array_equal(np.asarray(clone.array), DATA)
    assert clone.__dict__.get("_files") is not None


def test_an_entry_removed_after_its_call_is_read_on_in_its_process_and_forked_workers(
        tmp_path):
    """Another agent's budget may evict the entry a call just returned, before its Dataset
    reads a row: the process that holds the entry (and the workers it forks) read on
    through the entry's own mapping, the same bytes."""
    cache = cachekit.Cache(tmp_path / "root", progress=False)
    entry = data_entry(tmp_path / "root")
    dataset = entry.dataset(targets=np.arange(ROWS))
    cache.clear([entry.key])
    assert not entry.path.exists()
    x, y = dataset[3]
    np.testing.assert_array_equal(x.numpy(), DATA[3])
    forked = entry.dataset(targets=np.arange(ROWS))  # not read before its workers start
    seen = []
    for x, y in loader(forked, num_workers=2, multiprocessing_context="fork"):
        np.testing.assert_array_equal(x.numpy(), DATA[y.numpy()])
        seen += y.tolist()
    assert sorted(seen) == list(range(ROWS))


def test_removed_entry_says_so_in_the_main_process_and_a_new_call_builds_it(tmp_path):
    """A Dataset of an entry that this process does not hold (a plain pickle, as a Dask
    task gets it) says that the entry was removed and what to do."""
    cache = cachekit.Cache(tmp_path / "root", progress=False)
    dataset = pickle.loads(pickle.dumps(data_entry(tmp_path / "root").dataset()))
    cache.clear([dataset.entry.key])
    with pytest.raises(DatasetCorruptError) as raised:
        dataset[0]
    says_removed(raised.value)
    assert str(pickle.loads(pickle.dumps(raised.value))) == str(raised.value)
    again = data_entry(tmp_path / "root")  # what the message says to do
    assert again.source == "built"
    np.testing.assert_array_equal(again.dataset()[7].numpy(), DATA[7])


def test_dataset_error_survives_pickling_and_torch_reraise():
    direct = DatasetCorruptError("/x/entries/k/data.npy", "file is 3 bytes, expected 9")
    clone = pickle.loads(pickle.dumps(direct))
    assert (clone.path, clone.reason, str(clone)) == (direct.path, direct.reason, str(direct))
    # What torch's ExceptionWrapper.reraise does with a worker's exception:
    message = ("Caught DatasetCorruptError in DataLoader worker process 0.\nOriginal Traceback "
               f"(most recent call last):\n  ...\ncachekit.dataset.DatasetCorruptError: {direct}")
    reraised = DatasetCorruptError(message)
    assert isinstance(reraised, cachekit.CacheCorruptError) and isinstance(reraised, OSError)
    assert reraised.path == "/x/entries/k/data.npy" and str(reraised) == message
    assert str(pickle.loads(pickle.dumps(reraised))) == message
