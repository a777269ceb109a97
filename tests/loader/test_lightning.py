"""PyTorch Lightning trains with feedline.DataLoader and resumes mid-epoch exactly."""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from feedline import DataLoader  # noqa: E402

from .._system import starts_processes  # noqa: E402

N, BATCH = 24, 4  # 6 training steps per epoch


class _Indexed(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return torch.tensor(i), torch.full((3,), float(i))


@functools.cache
def _lightning() -> tuple[Any, Any]:
    """lightning.pytorch and the test's model, made when the test runs: importing lightning
    takes 4.5 s of CPU, which collecting the tests (in each pytest-xdist worker) would
    otherwise pay."""
    L = pytest.importorskip("lightning.pytorch")

    class Model(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)
            self.trained: list[list[int]] = []
            self.validated: list[list[int]] = []

        def training_step(self, batch: Any, _: int) -> Any:
            index, x = batch
            self.trained.append(index.tolist())
            return self.layer(x).pow(2).mean()

        def validation_step(self, batch: Any, _: int) -> None:
            self.validated.append(batch[0].tolist())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return L, Model


def _loaders() -> tuple[DataLoader[Any], DataLoader[Any]]:
    gen = torch.Generator().manual_seed(0)
    train = DataLoader(_Indexed(), batch_size=BATCH, shuffle=True, generator=gen)
    return train, DataLoader(_Indexed(), batch_size=6)


def _trainer(path: Path, **kw: Any) -> Any:
    L, _ = _lightning()
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=path,
        num_sanity_val_steps=0,
        **kw,
    )


@starts_processes
# Lightning draws from torch's generator while the first batch is fetched: not the dataset,
# so feedline must not warn that the dataset's draws are not reproducible.
@pytest.mark.filterwarnings("error:the dataset draws:RuntimeWarning")
def test_fit_resumed_mid_epoch_sees_exactly_the_uninterrupted_batches(tmp_path: Path) -> None:
    L, _Model = _lightning()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    torch.manual_seed(0)
    whole = _Model()
    _trainer(tmp_path / "whole", max_epochs=2, enable_checkpointing=False).fit(whole, *_loaders())
    assert len(whole.trained) == 12
    assert sorted(i for b in whole.trained[:6] for i in b) == list(range(N))
    assert whole.trained[:6] != whole.trained[6:]  # a new shuffle each epoch
    assert len(whole.validated) == 2 * 4

    # The same run, stopped after 8 steps (in the second epoch), with a checkpoint every 4.
    torch.manual_seed(0)
    first = _Model()
    saving = L.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}"
    )
    _trainer(tmp_path / "first", max_epochs=2, max_steps=8, callbacks=[saving]).fit(
        first, *_loaders()
    )
    assert first.trained == whole.trained[:8]
    for step in (4, 8):  # mid-epoch 0, and mid-epoch 1
        checkpoint = tmp_path / "ckpt" / f"step={step}.ckpt"
        assert checkpoint.exists()
        torch.manual_seed(123)  # a new process: another global random state
        resumed = _Model()
        trainer = _trainer(tmp_path / f"resumed{step}", max_epochs=2)
        trainer.fit(resumed, *_loaders(), ckpt_path=checkpoint)
        assert first.trained[:step] + resumed.trained == whole.trained
