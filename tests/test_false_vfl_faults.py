"""FALSE-VFL with a data party lost mid-step, in one process (the losing channel of
test_faults.py): at each message kind of a stage-1 or stage-2 step, training goes on with its
block missing, ``faults`` records it, and the surviving parties keep nothing of the abandoned
attempt. The process test in test_deploy.py kills a real party."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from conftest import MakeData
from test_faults import LOST, STEP, LosingChannel, LosingInEvaluation
from test_rejoin import FlakyChannel

from protocols.secagg import MaskingAggregator
from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import ProtocolError
from secure_vfl.federation.aggregator import SumBackend
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import (
    AGGREGATOR,
    AbortRequest,
    RepresentRequest,
    SealedSumMessage,
)
from secure_vfl.methods import MethodConfig
from secure_vfl.methods.base import REJOINED, in_process_parties, lost_parties, split_tensors
from secure_vfl.methods.false_vfl import (
    FalseVflConfig,
    FalseVflMethod,
    LatentParty,
    build_latent_party,
)

OPTIONS = FalseVflConfig(latent_dim=6, global_latent_dim=3, hidden=32, kappa=3, inference_samples=8)
CONFIG = MethodConfig(epochs=1, batch_size=64, labeled=100)


def _method(
    data: VerticalData,
    channel: Channel,
    *,
    variant: int = 1,
    config: MethodConfig = CONFIG,
    aggregator: SumBackend | None = None,
) -> FalseVflMethod:
    return FalseVflMethod(
        data,
        config,
        seed=3,
        variant=1 if variant == 1 else 2,
        name=f"false-vfl-{variant}",
        channel=channel,
        aggregator=aggregator,
        false_vfl=OPTIONS,
    )


def _survivors(method: FalseVflMethod) -> list[LatentParty]:
    parties = in_process_parties(method.fed.channel)
    return [p for p in parties if isinstance(p, LatentParty) and p.name != LOST]


def _left_over(party: LatentParty) -> list[str]:
    """What ``party`` still keeps of a step: kept forward passes, gradients, likelihoods,
    messages or gradients in its models."""
    kept = {
        "forward passes": party._pending,
        "gradients": party._gradients,
        "likelihoods": party._likelihood_pending,
        "inbox": party._inbox,
    }
    left = [what for what, store in kept.items() if store]
    modules: list[torch.nn.Module] = [party.latent_model]
    label_model = getattr(party, "label_model", None)
    if label_model is not None:
        modules.append(label_model)
    if any(p.grad is not None for m in modules for p in m.parameters()):
        left.append("model gradients")
    return left


@pytest.mark.parametrize(
    ("variant", "stage", "kind", "masks"),
    [
        (1, 1, "represent-request", False),  # noticed by the driver at the step's start
        (1, 1, "latent", False),  # the parties before it hold likelihoods for a gradient
        (1, 1, "gradient", False),  # the parties before it backpropagated their likelihoods
        (1, 1, "closing", False),  # its step's last message: the others complete the step
        (2, 1, "latent", False),
        (1, 1, "seal-request", True),
        (1, 2, "represent-request", False),
        (2, 2, "latent", False),
    ],
)
def test_a_party_lost_mid_step_is_dropped_and_false_vfl_goes_on(
    make_data: MakeData, variant: int, stage: int, kind: str, masks: bool
) -> None:
    data = make_data(train_missing="mcar:0.2")
    stage_one = -(-data.train.n // CONFIG.batch_size)  # steps of stage 1's one epoch
    step = STEP if stage == 1 else stage_one  # stage 2's first step: rounds run on
    closing = kind == "closing"
    kind = "gradient" if closing else kind
    channel = LosingChannel(kind, step=step, closing=closing)
    config = dataclasses.replace(CONFIG, secure_sums=masks)
    aggregator = MaskingAggregator() if masks else None
    method = _method(data, channel, variant=variant, config=config, aggregator=aggregator)
    assert len(method.sampler) == stage_one > STEP
    losses = method.fit()
    assert channel.lost
    assert method.fed.faults == [
        {
            "party": LOST,
            # A closing gradient goes with the next step's first messages: lost there.
            "step": step + 1 + closing,
            "epoch": stage,  # one epoch per stage, counted across both
            "phase": "training",
            "what": f"{kind} to {LOST}: its process is gone",
        }
    ]
    assert channel.after_loss == 0  # nothing was sent to it again
    assert len(losses) == 2 and all(np.isfinite(losses))
    for party in _survivors(method):
        assert _left_over(party) == [], party.name
    for name in data.tests:
        predicted = method.predict(name)
        assert (predicted[:, 2] == -1).all()  # its block is missing in evaluation
        assert (predicted >= 0).any(axis=1).all()  # and every sample is still predicted


def test_an_abandoned_stage_one_step_leaves_nothing_to_apply(make_data: MakeData) -> None:
    # A step carried up to its update, the furthest a retried attempt gets: every party has
    # backpropagated its likelihood gradient into its decoder, the label party holds its own
    # posterior gradient and its own backward pass (the others' posterior gradients, which
    # would close their steps, are still the driver's, unsent). Abandoning it must leave
    # nothing for an update to apply.
    data = make_data(train_missing="mcar:0.2")
    method = _method(data, Channel())
    fed = method.fed
    _, closing = method._attempt(np.arange(CONFIG.batch_size), 0, 0)
    label = method.label_party.name
    assert closing and sorted(m.receiver for m in closing) == [n for n in fed.names if n != label]
    parties = _survivors(method)
    assert all("model gradients" in _left_over(party) for party in parties)  # it can fail
    assert [p.name for p in parties if "gradients" in _left_over(p)] == [label]
    modules = [*(p.latent_model for p in parties), method.label_party.label_model]
    before = [t.detach().clone() for m in modules for t in m.parameters()]
    fed.send_or_drop(
        [AbortRequest(**fed.header(name, 0, 0)) for name in [*fed.live(), AGGREGATOR]], round=0
    )
    for party in parties:
        assert _left_over(party) == [], party.name
    fed.update(round=0, tag="stage1/posterior")
    method.label_party.generative_optimizer.step()
    after = [t.detach() for m in modules for t in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("variant", [1, 2])
def test_a_party_lost_in_evaluation_is_dropped_and_false_vfl_predicts_without_it(
    make_data: MakeData, variant: int
) -> None:
    data = make_data(train_missing="mcar:0.2")
    first, second = data.tests
    channel = LosingInEvaluation(second)
    method = _method(data, channel, variant=variant)
    method.fit()
    assert (method.predict(first)[:, 2] >= 0).any() and not channel.lost
    predicted = method.predict(second)
    assert channel.lost
    assert method.fed.faults == [
        {
            "party": LOST,
            "step": method.total_steps,
            "epoch": 2,  # stage 2's one epoch, counted across both stages
            "phase": "evaluation",
            "what": f"latent to {LOST}: its process is gone",  # FALSE-VFL's request kind
        }
    ]
    assert (predicted[:, 2] == -1).all() and (predicted >= 0).any(axis=1).all()
    for party in _survivors(method):
        assert _left_over(party) == [], party.name


def _latent_readmission(
    channel: Channel, data: VerticalData, config: MethodConfig, variant: int
) -> list[str]:
    """The readmission of a restarted FALSE-VFL data party: built anew by the seed rule of
    a deployed one (its initial models), in place of the lost one."""
    readmitted: list[str] = []
    splits = split_tensors(data)

    def readmit(name: str) -> int:
        k = int(name.removeprefix("party-"))
        party = build_latent_party(
            k,
            name,
            method=f"false-vfl-{variant}",
            blocks={key: torch.from_numpy(split.blocks[k]) for key, split in splits.items()},
            observed={key: torch.from_numpy(split.mask[:, k]) for key, split in splits.items()},
            shapes=data.block_shapes,
            config=config,
            options=OPTIONS,
            seed=3,
        )
        channel.detach(name)
        party.connect(channel)
        readmitted.append(name)
        return 0  # initial models: no checkpoint restored

    channel.readmit = readmit
    return readmitted


@pytest.mark.parametrize("variant", [1, 2])
def test_a_party_lost_in_stage_one_rejoins_at_its_next_epoch_and_not_in_stage_two(
    make_data: MakeData, variant: int
) -> None:
    data = make_data(train_missing="mcar:0.2")
    config = dataclasses.replace(CONFIG, epochs=2)  # two epochs per stage
    stage_one = -(-data.train.n // config.batch_size)  # steps of one stage-1 epoch
    # Lost at step 2 of stage 1, back at the first probe (the start of stage 1's epoch 2).
    channel = FlakyChannel("represent-request", losses=(1,), back_at=(1,))
    readmitted = _latent_readmission(channel, data, config, variant)
    method = _method(data, channel, variant=variant, config=config)
    losses = method.fit()
    assert readmitted == [LOST] and channel.probes == 1
    assert [(f["party"], f["step"], f["epoch"], f["what"]) for f in method.fed.faults] == [
        (LOST, 2, 1, f"represent-request to {LOST}: its process is gone"),
        (LOST, stage_one + 1, 2, REJOINED),
    ]
    assert lost_parties(method.fed.faults) == [] and all(np.isfinite(losses))
    asked = {
        m.round
        for m in channel.posted
        if isinstance(m, RepresentRequest) and m.receiver == LOST and m.phase == "train"
    }
    assert {0, 1, stage_one} <= asked and not asked & set(range(2, stage_one))
    for name in data.tests:  # observed again at evaluation
        predicted = method.predict(name)
        assert np.array_equal(predicted[:, 2] >= 0, data.tests[name].mask[:, 2])


def test_a_party_lost_in_stage_two_is_not_probed(make_data: MakeData) -> None:
    data = make_data(train_missing="mcar:0.2")
    config = dataclasses.replace(CONFIG, epochs=2)
    stage_one = 2 * -(-data.train.n // config.batch_size)  # both stage-1 epochs
    channel = FlakyChannel("represent-request", losses=(stage_one,), back_at=(1,))
    readmitted = _latent_readmission(channel, data, config, 1)
    method = _method(data, channel, config=config)
    method.fit()
    assert readmitted == [] and channel.probes == 0
    assert lost_parties(method.fed.faults) == [LOST]


def test_under_masks_a_late_sealed_sum_of_the_abandoned_attempt_is_dropped(
    make_data: MakeData, caplog: pytest.LogCaptureFixture
) -> None:
    """The label party expects its posterior's sum, sealed under masks. A late one of the
    attempt abandoned for a lost party was refused before its key did any work (a plain one was
    dropped, as every late reply the driver expected); now it is dropped too, unopened, and a
    sealed sum for another tag of that round is still refused."""
    data = make_data(train_missing="mcar:0.2")
    channel = LosingChannel("seal-request", step=STEP)
    config = dataclasses.replace(CONFIG, secure_sums=True)
    method = _method(data, channel, config=config, aggregator=MaskingAggregator())
    method.fit()
    label = method.label_party
    [key] = [key for key in label._abandoned_expected if key[0] == "sum"]
    _, _, round, batch_id, tag = key
    names = tuple(method.fed.names)
    late = SealedSumMessage(
        sender=AGGREGATOR,
        receiver=label.name,
        round=round,
        batch_id=batch_id,
        session=method.fed.session,
        scheme="masks",
        tag=tag or "",
        width=4,
        selection=torch.ones(1, 3, len(names), dtype=torch.bool),
        parties=names,
        payload=(b"\0" * 96,),  # never opened: no key does any work on it
    )
    inbox = list(label._inbox)
    with caplog.at_level(logging.INFO, logger="secure_vfl.federation.parties"):
        label.receive(late)
    assert label._inbox == inbox
    assert "a late sealed-sum from aggregator of the abandoned attempt" in caplog.text
    with pytest.raises(ProtocolError, match="that it did not ask for"):
        label.receive(dataclasses.replace(late, tag="another"))
