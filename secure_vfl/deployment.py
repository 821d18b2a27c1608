"""A deployed run: every party its own process, on its own machine, over gRPC with mutual TLS.

The label party (``secure-vfl train --federation FED --name LABEL``) drives, as in one process;
each data party (``secure-vfl party serve --federation FED --name NAME``) and the aggregation
server (``--name aggregator``) act on what arrives until the label party ends the run. What
crosses, besides the training messages of the in-process run, is :class:`~secure_vfl.
federation.messages.DeploymentMessage` s, each a JSON object checked on arrival:

0. ``roster`` (what every copy of the federation file must agree on: the label party, each
   member's name and address in order, the CA certificate's SHA-256), to every other process
   at once: one whose own copy differs refuses the run, naming how (:func:`check_rosters`), as
   do an imputation and a prediction.
1. Alignment, by the plain join (``--align join``, the default) or by PSI (``--align psi``):

   - ``ids-request`` -> ``ids``: each data party sends its ids and block width to the label
     party, which joins them (it learns every party's ids).
   - ``psi`` (a fresh session id, the mode) -> ``psi-ready`` (the block width): each data party
     takes the responder's side of a DH-PSI session with the label party (the roles come from
     the composition root, ``PsiRoles``); then the label party runs each session over the
     network, one party after the other, and sends each party its matches. The label party
     learns which of its ids each party holds (the availability mask) and how many ids it has;
     a data party learns which of its ids are aligned and at which sample positions (as
     :class:`protocols.psi.PsiAligner` in one process). No ids cross in the clear.
2. The label party splits and draws the masks from the alignment and shapes alone
   (:func:`~secure_vfl.data.vertical.plan_rows_by`); ``fit`` gives each data party its
   training rows, on which it fits its own preprocessing (categories one-hot encoded, empty
   cells filled, with indicators) and answers ``fitted`` with its model input's shape
   (:func:`fitted_widths`); then ``setup`` tells each data party the
   method, its configuration, the seed, the party's index and names, its rows per split (rows
   of its own table under the join; under PSI, sample positions, which the party maps to its
   rows by what PSI told it, so the label party never holds its rows or ids), the secure-sum
   scheme and, where it holds heads (``heads="all"``, Combinatorial), the training labels of
   the rows it holds. The party fits
   its standardiser on its own rows and builds itself with
   :func:`~secure_vfl.methods.base.build_party` and the method's seed rule
   (:data:`~secure_vfl.methods.base.PARTY_MODELS`): the same models as in one process. A
   FALSE-VFL party (:data:`LATENT_METHODS`; the set-up also carries FALSE-VFL's options) builds
   its encoder, decoder and missingness model, optimiser and generator by FALSE-VFL's own seed
   rule (:func:`~secure_vfl.methods.false_vfl.build_latent_party`) and is handed no label:
   only the label party knows which training rows are labelled. Its
   secure-sum halves are made inside it; keys meet by messages as in one process. Under DP
   the set-up's ``privacy`` part is the party's share of the label party's privacy plan
   (:func:`privacy_plans`), from which it installs its own mechanisms with its own noise and
   accountant (:func:`served_privacy`, by the composition root's factory).
3. Training and evaluation run as in one process (:func:`~secure_vfl.experiment.run_training`).
4. ``save`` (``train --federation`` saves the model, :func:`save_deployed`): the label party
   sends each live data party the model's run id; the party writes its own part into its own
   model directory (``party serve --model-dir DIR``: ``DIR/NAME/RUN_ID/``, :class:`ServedModel`)
   and answers ``saved`` with the SHA-256 of each file. The label party writes its own part
   into ``OUT/model/`` and the manifest last, with every party's hashes and where its part lies.
5. ``end`` (with the outcome) is answered by a ``report``: the bytes the party sent and, under
   DP, what its own accountant priced (its guarantees), which the label party adds to the
   result's privacy report. A party that hears nothing from the label party for longer than
   its deadline exits non-zero.

Checkpoints (``train --checkpoint-every N``, ``--resume DIR``): right after ``setup`` the
label party sends each data party ``checkpoints`` (the run id and, on resume, the step and the
SHA-256 of the party's manifest it recorded), and the party restores its own checkpoint of that
step from its own directory (``party serve --checkpoint-dir DIR --resume``) or refuses; every N
steps a ``checkpoint`` has each data party write its own and answer with its manifest's
SHA-256, and the label party writes its own last with those hashes (the commit,
:class:`~secure_vfl.checkpoints.RunCheckpoints`). Nothing but hashes crosses; the aggregation
server keeps nothing between steps and is not asked.

A data party lost mid-training (its process died: a step fails and the party accepts no
connection) is dropped by LASER's or FALSE-VFL's driver
(:meth:`~secure_vfl.methods.base.Federation.recover`): its block is missing from then on, it
is sent nothing more (not even ``end``) unless it rejoins, and the result's ``faults`` names it.
A lost aggregator, or a lost party under another method, fails the run.

Under LASER a lost data party may **rejoin at an epoch boundary** (:meth:`~secure_vfl.methods.base.
Federation.rejoin`; under FALSE-VFL in stage 1 only, whose epochs train the data parties'
encoders): at the start of every epoch after the first the label party probes each
lost party with a fresh connection (mutual TLS, so only a process holding that party's
certificate from the federation's CA answers; all at once, quick: an address that refuses is
not back, see :data:`~secure_vfl.federation.network.REJOIN_PROBE_SECONDS`). One that answers,
a new ``party serve`` process its operator started at the same address, is sent the ``setup``
it had at the start of the run (:func:`readmission`, :func:`rejoin_setup`: it rebuilds its
initial models by the seed rule; with deployed checkpoints it then restores its checkpoint in
the last commit that held it, if its directory still has it), gets its availability column back
from the label party's record of it, and a new session opens, in which every live party
announces its secure-sum keys again (the rejoined party's are new; a key of the old session is
refused). From that step on it trains and is evaluated, and is sent ``end`` at the close;
``faults`` has a second entry, ``{"party", "step", "epoch", "what": "rejoined"}`` (with
``"restored"``, the step of the checkpoint it restored, if it did). With deployed checkpoints it
also takes the run's checkpoints from the label party's last commit on
(:meth:`DeployedCheckpoints.rejoined`). Lost again, it is dropped again. Under
``--align psi`` the restarted party first runs PSI with the label party again, in a new session
(its PSI state died with its first process; :meth:`PsiAlignment.realign`), and must find the
run's intersection. Under DP a lost party rejoins only with checkpoints: it takes back the
releases of its first process from its release journal beside them
(:func:`~secure_vfl.checkpoints.rejoin_from_journal`); without, it stays lost.
The core never imports the privacy layer: the command line passes the secure-sum backend
(``secure_sums``) and the PSI roles (``psi``) in.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import secrets
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import numpy as np
import torch
from torch import Tensor

from secure_vfl import checks
from secure_vfl.checkpoints import (
    CheckpointPlan,
    ResumePoint,
    drop_older,
    party_state,
    read_checkpoint,
    rejoin_from_journal,
    restore_party_state,
    resumed_schedule,
    start_journal,
    step_directory,
    write_checkpoint,
    written_steps,
)
from secure_vfl.data.missingness import parse_mechanism
from secure_vfl.data.party_files import (
    ID_COLUMN,
    LABEL_COLUMN,
    LabelTable,
    PartyTable,
    read_label_file,
    read_party_file,
)
from secure_vfl.data.party_preprocessing import (
    DEFAULT_MISSING_POLICY,
    MISSING_POLICIES,
    PartyPreprocessing,
)
from secure_vfl.data.vertical import (
    AlignLabelIds,
    RowPlan,
    VerticalData,
    VerticalSplit,
    party_blocks,
    plan_rows_by,
)
from secure_vfl.errors import (
    ConfigError,
    DataError,
    IntegrityError,
    NotSetUpError,
    ProtocolError,
    SecureVFLError,
    TransportError,
)
from secure_vfl.federation.aggregator import PlainAggregator, SealingScheme, SumBackend
from secure_vfl.federation.alignment import Alignment, JoinAligner, check_unique_ids
from secure_vfl.federation.certificates import TlsIdentity
from secure_vfl.federation.channel import Channel, Readmission
from secure_vfl.federation.federation_file import Federation, roster_differences
from secure_vfl.federation.messages import AGGREGATOR, DeploymentMessage, Message
from secure_vfl.federation.network import PROBE_SECONDS, NetworkChannel, PartyEndpoint
from secure_vfl.federation.parties import ROLES, DataParty, Party, make_aggregation_server
from secure_vfl.federation.parts import TrainingSamples
from secure_vfl.federation.wire import shown
from secure_vfl.io import (
    atomic_directory,
    check_directory,
    check_keys,
    parse_json,
    remove_directory,
)
from secure_vfl.saved_model import (
    DATA_PARTY_ROLE,
    KEPT_BY_PARTY,
    LOST,
    MANIFEST_FILE,
    MAX_CLASSES,
    MAX_INPUT_WIDTH,
    Manifest,
    PartEntry,
    new_run_id,
    replace_directory,
    saved_here,
    write_manifest,
)

if TYPE_CHECKING:
    from secure_vfl.data.samplers import BatchSampler
    from secure_vfl.deployed_imputation import ServedClient, StatisticsPrivacyFactory
    from secure_vfl.experiment import PrivacyLayer
    from secure_vfl.methods.base import MethodConfig

logger = logging.getLogger(__name__)

MAX_LAYER_WIDTH = 4096
"""The widest layer a label party may ask a served party to build (a representation, a hidden or
latent layer, an imputation model's width or neighbours): a bound on what a peer may say, so
that one set-up cannot make a party allocate without limit. The papers' settings use 512 at
most."""
MAX_LAYERS = 64
"""The deepest model a label party may ask a served imputation client to build."""
MAX_LOCAL_EPOCHS = 1000
"""The most local epochs a label party may ask of a served imputation client per FedAvg round
(the papers use 1-5): one request cannot make a client train without end."""


def check_requested(where: str, values: Mapping[str, Any], limits: Mapping[str, int]) -> None:
    """ProtocolError if a set-up asks for more than ``limits`` allow (a field of ``values``
    above its limit): what a label party may ask a served party to build is bounded."""
    for field, limit in limits.items():
        value = values.get(field)
        if isinstance(value, int) and value > limit:
            raise ProtocolError(
                f"{where}: `{field}` of at most {limit} expected, found {value} (a bound on "
                "what a label party may ask this party to build)."
            )


SecureSums = Callable[[str], SumBackend | None]
"""The secure-sum backend of a scheme name (``"none"``: None), made by the composition root."""


class PsiParty(Protocol):
    """A PSI side as an actor (:class:`~secure_vfl.federation.parties.Party`)."""

    def connect(self, channel: Channel) -> None: ...

    def receive(self, message: Message) -> None: ...


class PsiIntersection(Protocol):
    """What the label party learns from one PSI session (intersection mode)."""

    @property
    def indices(self) -> np.ndarray | None: ...

    @property
    def peer_size(self) -> int: ...


class PsiRequesting(PsiParty, Protocol):
    """The label party's PSI side (:class:`protocols.psi.PsiRequester`)."""

    def intersect(self, peer: str, *, session_id: str, mode: str = ...) -> PsiIntersection: ...

    def send_matches(self, peer: str, sample_of: np.ndarray, samples: int) -> None: ...


class PsiResponding(PsiParty, Protocol):
    """A data party's PSI side (:class:`protocols.psi.PsiResponder`)."""

    def accept(self, peer: str, *, session_id: str, mode: str = ...) -> None: ...

    def aligned_rows(self, peer: str) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class PsiRoles:
    """The two sides of DH-PSI, each made from a party's ids and name: handed in by the
    composition root (the core never imports the privacy layer)."""

    requester: Callable[[np.ndarray, str], PsiRequesting]
    responder: Callable[[np.ndarray, str], PsiResponding]


class ServedPrivacy(Protocol):
    """A deployed data party's own half of the privacy layer
    (:class:`protocols.party_privacy.PartyPrivacy`): its mechanisms, installed inside it, and
    its accountant, whose priced releases it reports at the end of the run."""

    def entry(self) -> dict[str, Any]:
        """What its accountant priced, as JSON (the ``privacy`` of its end-of-run report)."""
        ...


PartyPrivacyFactory = Callable[[str, Any, DataParty], ServedPrivacy]
"""A data party's half from (its name, the ``privacy`` part of its set-up, the party built),
installed in the party (:func:`protocols.party_privacy.served_privacy`); ProtocolError for a
malformed part. Handed in by the composition root."""

if TYPE_CHECKING:

    class DeployedPrivacy(PrivacyLayer, Protocol):
        """What the label party of a deployment needs of the privacy layer
        (:class:`protocols.privacy.PrivacyEngine`) besides what a run needs: the other parties'
        plans before it sets them up, and their reports at the end."""

        def plan_parties(
            self,
            sampler: BatchSampler,
            *,
            n: int,
            epochs: int,
            method: str,
            method_config: MethodConfig,
            names: Sequence[str],
            predictions: int,
            resumed: Callable[[Any], None] | None = None,
            present: Any = None,
        ) -> dict[str, dict[str, Any] | None]: ...

        def take_reports(self, reports: Mapping[str, Any]) -> None: ...


PSI_MODE = "intersection"
"""The mode of alignment's PSI: the label party learns which of its ids each party holds."""
_SESSION_ID = re.compile(r"[0-9a-f]{32}")

DEPLOYED_METHODS = (
    "laser",
    "local",
    "ensemble",
    "standard",
    "plugvfl",
    "combinatorial",
    "false-vfl-1",
    "false-vfl-2",
)
LATENT_METHODS = ("false-vfl-1", "false-vfl-2")
"""FALSE-VFL: its data parties are built by its own seed rule (:func:`served_models`)."""
SETUP_DEADLINE = 600.0
"""How long the label party waits for a party to build itself (SimSiam pretraining included)."""


def _body(message: Message, topic: str, expected: Mapping[str, type | tuple[type, ...]]) -> Any:
    """The JSON body of a deployment message of ``topic`` with exactly the keys ``expected``
    (each of its type); ProtocolError naming what was expected and found otherwise."""
    if not isinstance(message, DeploymentMessage) or message.topic != topic:
        found = getattr(message, "topic", message.kind)
        raise ProtocolError(f"a deployment {topic!r} message expected; found {found!r}.")
    where = f"{topic} from {message.sender}"
    body = parse_json(message.body, where, error=ProtocolError)
    return check_keys(body, expected, refuse=lambda wrong: ProtocolError(f"{where}: {wrong}."))


def _rows(value: Any, what: str, *, low: int, high: int) -> np.ndarray:
    """A list of ints in [low, high) as int64; ProtocolError otherwise."""
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ProtocolError(f"setup: `{what}` must be a list of integers.")
    rows = np.asarray(value, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < low or rows.max() >= high):
        raise ProtocolError(f"setup: `{what}` must lie in [{low}, {high}); found out of range.")
    return rows


def _deployment(sender: str, receiver: str, topic: str, body: Mapping[str, Any]) -> Message:
    return DeploymentMessage(
        sender=sender, receiver=receiver, round=0, batch_id=0, topic=topic, body=json.dumps(body)
    )


# -- a data party or the aggregation server: serving until the label party ends the run -------


class _Server:
    """What a serving process does with what arrives: deployment messages from the label party
    (ids or PSI, set-up, end) itself; PSI messages go to its PSI side (made when the label party
    asks for ``psi``), every other message to the party it built at set-up."""

    def __init__(
        self,
        federation: Federation,
        name: str,
        endpoint: PartyEndpoint,
        secure_sums: SecureSums,
        table: PartyTable | None,
        on_event: Callable[[str], None],
        psi: PsiRoles | None = None,
        psi_only: bool = False,
        checkpoints: ServedCheckpoints | None = None,
        model: ServedModel | None = None,
        party_privacy: PartyPrivacyFactory | None = None,
        imputed_dir: Path | None = None,
        statistics_privacy: StatisticsPrivacyFactory | None = None,
    ) -> None:
        self.imputed_dir = imputed_dir
        self.statistics_privacy = statistics_privacy
        self.imputation: ServedClient | None = None
        self.checkpoints = checkpoints or ServedCheckpoints(name, None, resume=False)
        self.model = model or ServedModel(name, None)
        self.party_privacy = party_privacy
        self.privacy: ServedPrivacy | None = None
        self.on_event = on_event
        self.psi = psi
        self.psi_only = psi_only
        self.responder: PsiResponding | None = None
        self.federation = federation
        self.name = name
        self.endpoint = endpoint
        self.secure_sums = secure_sums
        self.table = table
        self.party: Party | None = None
        self.outcome: str | None = None
        self.stepped = False

    def receive(self, message: Message) -> None:
        if isinstance(message, DeploymentMessage):
            if message.sender != self.federation.label_party:
                label = self.federation.label_party
                raise ProtocolError(
                    f"{self.name}: a deployment message ({message.topic!r}) from "
                    f"{message.sender}, but its federation file names {label} the label party, "
                    "the only one that sets a run up or ends it: do the two parties' federation "
                    "files differ?"
                )
            handlers = {
                "roster": self._on_roster,
                "ids-request": self._on_ids_request,
                "psi": self._on_psi,
                "fit": self._on_fit,
                "setup": self._on_setup,
                "checkpoints": self._on_checkpoints,
                "checkpoint": self._on_checkpoint,
                "save": self._on_save,
                "columns-request": self._on_columns_request,
                "impute-setup": self._on_impute_setup,
                "impute-save": self._on_impute_save,
                "predict-setup": self._on_predict_setup,
            }
            handler = handlers.get(message.topic, self._on_end)
            if message.topic not in (*handlers, "end"):
                raise ProtocolError(
                    f"{self.name}: a deployment message ({message.topic!r}) from "
                    f"{message.sender}, which a data party does not take."
                )
            handler(message)
            return
        if self.party is None and self.responder is not None:
            self.responder.receive(message)  # PSI messages; the responder refuses any other
            return
        if self.party is None:
            raise NotSetUpError(
                self.name,
                f"{self.name}: a {message.kind} from {message.sender} before the run was set up "
                "(this process was started after the run set up the one before it?).",
            )
        self.checkpoints.check_ready(message.kind)
        self.party.receive(message)
        # A training step ends at its update (or a gradient that closes it); an imputation
        # client's at its local training for FedAvg.
        closes = message.kind == "update" or getattr(message, "step", False) is True
        closes |= getattr(message, "computation", None) == "train"
        if closes and not self.stepped:
            self.stepped = True
            self.on_event(f"{self.name}: its first training step is done")

    def _reply(self, topic: str, body: Mapping[str, Any]) -> None:
        self.endpoint.send(_deployment(self.name, self.federation.label_party, topic, body))

    def _on_roster(self, message: Message) -> None:
        """Refuse a run whose label party's federation file differs from this party's in what
        every copy must agree on (:meth:`Federation.roster`), naming how."""
        body = _body(message, "roster", {"label_party": str, "members": list, "ca_sha256": str})
        if not all(
            isinstance(m, list) and len(m) == 2 and all(isinstance(t, str) for t in m)
            for m in body["members"]
        ):
            raise ProtocolError(f"roster from {message.sender}: [name, address] pairs expected.")
        differences = roster_differences(self.federation.roster(), body, them=message.sender)
        if differences:
            raise ProtocolError(
                f"{self.name}: the federation file of {message.sender} differs from this "
                f"party's ({self.federation.path}): {'; '.join(differences)}. Every party "
                "expected the same file (its own paths aside)."
            )

    def _on_ids_request(self, message: Message) -> None:
        _body(message, "ids-request", {})
        if self.table is None:
            raise ProtocolError(f"{self.name} holds no table; it has no ids to send.")
        if self.psi_only or self.responder is not None:
            raise ProtocolError(
                f"{self.name} aligns by PSI only (`party serve --align psi`, or PSI already "
                "ran): it sends no ids in the clear; run `train --align psi`."
            )
        self._reply("ids", {"ids": self.table.ids.tolist(), "width": len(self.table.columns)})

    def _on_psi(self, message: Message) -> None:
        """Take the PSI responder's side of the label party's session (its id and mode), then
        answer with this party's block width: its ids never leave it."""
        body = _body(message, "psi", {"session": str, "mode": str})
        if self.table is None:
            raise ProtocolError(f"{self.name} holds no table; it has no ids to align.")
        if self.psi is None:
            raise ProtocolError(f"{self.name}: PSI is not offered by this process.")
        if self.responder is not None or self.party is not None:
            raise ProtocolError(f"{self.name}: a second PSI of the run (a replay?).")
        if body["mode"] != PSI_MODE or not _SESSION_ID.fullmatch(body["session"]):
            raise ProtocolError(
                f"psi: mode {PSI_MODE!r} and a session id of 32 hex digits expected; found "
                f"mode {body['mode']!r}, session {body['session'][:40]!r}."
            )
        responder = self.psi.responder(self.table.ids, self.name)
        self._attach(responder)
        responder.accept(message.sender, session_id=body["session"], mode=body["mode"])
        self.responder = responder
        self.on_event(f"{self.name}: aligning by PSI with {message.sender}")
        self._reply("psi-ready", {"width": len(self.table.columns)})

    def _attach(self, party: PsiParty | Party) -> None:
        """Connect ``party`` to the network as this process's party; deployment messages stay
        this server's (it hands the party the rest)."""
        channel = NetworkChannel(self.endpoint)
        self.endpoint.handler = None  # the channel attaches the party to the endpoint
        party.connect(channel)
        if isinstance(party, Party):  # its requests and plans come from the label party only
            party.driver = self.federation.label_party
        self.endpoint.handler = self.receive

    def _on_fit(self, message: Message) -> None:
        """Fit this party's preprocessing on the training rows the label party planned for it
        and answer with the shape of its model input (what its categories and empty cells make
        of its columns), so that every party builds its models on the shapes of the run."""
        if self.party is not None or self.table is None:
            raise ProtocolError(f"{self.name}: a fit after the set-up, or at the aggregator.")
        body = _body(message, "fit", {"fit_rows": list, "align": str, "missing_cells": str})
        aligned = None
        if self.responder is not None:
            aligned = self.responder.aligned_rows(message.sender)
        fitted = fit_served_preprocessing(
            self.name,
            self.table,
            body["fit_rows"],
            body["align"],
            aligned,
            missing_cells=served_missing_cells("fit", body),
        )
        self._reply("fitted", {"shape": list(fitted.block_shape)})

    def _on_setup(self, message: Message) -> None:
        if self.party is not None:
            raise ProtocolError(f"{self.name}: a second set-up of the run (a replay?).")
        if self.name == AGGREGATOR:
            body = _body(message, "setup", {"secure_agg": str})
            self.party = _aggregation_server(self.secure_sums(body["secure_agg"]))
        else:
            assert self.table is not None
            aligned = None
            if self.responder is not None:
                aligned = self.responder.aligned_rows(message.sender)
            party = build_served_party(
                self.name, message, self.table, self.secure_sums, aligned=aligned
            )
            self.privacy = served_privacy(self.name, message, party, self.party_privacy)
            self.party = party
        self._attach(self.party)
        doing = "serving its sums" if self.name == AGGREGATOR else "training"  # or predicting
        self.on_event(f"{self.name}: set up by {message.sender}; {doing}")

    def _on_columns_request(self, message: Message) -> None:
        """An imputation run: answer with this client's feature columns and row count."""
        from secure_vfl.deployed_imputation import served_columns

        if self.name == AGGREGATOR or self.party is not None:
            raise ProtocolError(
                f"{self.name}: a columns-request at the aggregator or after the set-up."
            )
        self._reply("columns", served_columns(self.federation.member(self.name), message))

    def _on_impute_setup(self, message: Message) -> None:
        """An imputation run: build this client's part (its rows, split, model and halves)."""
        from secure_vfl.deployed_imputation import build_served_client

        if self.name == AGGREGATOR or self.party is not None:
            raise ProtocolError(
                f"{self.name}: an impute-setup at the aggregator or a second one (a replay?)."
            )
        self.imputation = build_served_client(
            self.federation.member(self.name),
            message,
            self.secure_sums,
            self.statistics_privacy,
            clients=sum(
                1 for m in self.federation.parties if m.name != self.federation.label_party
            ),
        )
        self.privacy = self.imputation.privacy
        self.party = self.imputation.party
        self._attach(self.party)
        self.on_event(f"{self.name}: set up by {message.sender} as an imputation client")
        if self.privacy is not None:
            self.on_event(
                f"{self.name}: clips and noises its own statistics, priced by its own accountant"
            )

    def _on_predict_setup(self, message: Message) -> None:
        """A prediction: load this party's own part of the saved model and hold its new rows."""
        from secure_vfl.deployed_prediction import build_predicting_party

        if self.party is not None or self.table is None:
            where = "at the aggregator" if self.table is None else "after a set-up (a replay?)"
            raise ProtocolError(f"{self.name}: a predict-setup {where}.")
        aligned = None
        if self.responder is not None:
            aligned = self.responder.aligned_rows(message.sender)
        party = build_predicting_party(
            self.name, message, self.table, self.model, self.secure_sums, aligned=aligned
        )
        self.party = party
        self._attach(party)
        self.on_event(
            f"{self.name}: predicting with its own part of the model, set up by {message.sender}"
        )

    def _on_impute_save(self, message: Message) -> None:
        """An imputation run: write this client's imputed table into its own directory."""
        if self.imputation is None or self.imputed_dir is None:
            raise ProtocolError(f"{self.name}: an impute-save before an imputation set-up.")
        answer, path = self.imputation.save(self.imputed_dir, message)
        self._reply("impute-saved", answer)
        self.on_event(f"{self.name}: wrote its imputed table to {path}")

    def _on_checkpoints(self, message: Message) -> None:
        """Take the run's checkpoints before training or at a rejoin (on resume, or at a
        rejoin after a commit that held it: restore this party's own)."""
        body = _body(message, "checkpoints", CHECKPOINTS_KEYS)
        answer = self.checkpoints.start(self._checkpointing(body), body)
        self._reply("checkpoints-ready", answer)
        if answer["step"]:
            self.on_event(f"{self.name}: restored its checkpoint of step {answer['step']}")

    def _on_checkpoint(self, message: Message) -> None:
        """Write this party's own checkpoint of the step the label party names."""
        body = _body(message, "checkpoint", CHECKPOINT_KEYS)
        self._reply("checkpointed", self.checkpoints.write(self._checkpointing(body), body))
        self.on_event(f"{self.name}: wrote its checkpoint of step {body['step']}")

    def _on_save(self, message: Message) -> None:
        """Write this party's own part of the trained model into its own model directory (an
        imputation client: its own imputer, to fill new rows of its own alone)."""
        body = _body(message, "save", SAVE_KEYS)
        run = str(body["run"])
        if self.imputation is not None:
            imputation = self.imputation
            answer = self.model.save(lambda tmp: imputation.save_model(tmp, run), body)
            where = self.model.part_directory(run)
            self.on_event(f"{self.name}: saved its imputer {run} (secure-vfl fill --model {where})")
        else:
            party = self._data_party(f"a save (run {run[:40]!r})", "saves a part")
            answer = self.model.save(party.save_part, body)
            self.on_event(f"{self.name}: saved its part of model {run}")
        self._reply("saved", answer)

    def _checkpointing(self, body: Mapping[str, Any]) -> DataParty:
        return self._data_party(
            f"a checkpoint request (step {body.get('step')!r})", "keeps checkpoints"
        )

    def _data_party(self, request: str, does: str) -> DataParty:
        """The data party built at set-up, for ``request`` that only such a party ``does``:
        NotSetUpError before the set-up (a process that replaced the one the run set up),
        ProtocolError at the aggregator."""
        if isinstance(self.party, DataParty):
            return self.party
        where = "before the run was set up" if self.party is None else "at the aggregator"
        refusal = f"{self.name}: {request} {where}; only a set-up data party {does}."
        if self.party is None:
            raise NotSetUpError(self.name, refusal)
        raise ProtocolError(refusal)

    def _on_end(self, message: Message) -> None:
        body = _body(message, "end", {"outcome": str})
        self.outcome = body["outcome"]
        removed = self.model.end(self.outcome)
        if removed is not None:
            self.on_event(f"{self.name}: removed its part {removed}: the run ended without a model")
        sent = [[s, r, p, n] for (s, r, p), n in sorted(self.endpoint.bytes.items())]
        privacy = self.privacy.entry() if self.privacy is not None else None
        self._reply("report", {"bytes": sent, "privacy": privacy})


CHECKPOINTS_KEYS: dict[str, type | tuple[type, ...]] = {
    "run": str,
    "every": int,
    "step": int,
    "manifest": (str, type(None)),
    "committed": (int, type(None)),
    "rejoin": bool,
}
"""``checkpoints``: the run id, the steps between checkpoints and, on resume, the step to
restore and the SHA-256 of the party's manifest of it (a fresh run: step 0, no manifest; a
rejoin: the party's checkpoint in the last commit that held it, or step 0 and no manifest if
none did), the label party's last commit (none at a fresh start; the step on resume; the
latest at a rejoin: the party's first checkpoint names it as the last commit), and whether the
party rejoins (a DP party then takes back its releases from its journal of the run)."""
CHECKPOINT_KEYS: dict[str, type | tuple[type, ...]] = {
    "run": str,
    "step": int,
    "committed": (int, type(None)),
}
"""``checkpoint``: the run id, the step to write and the label party's last committed step."""
CHECKPOINTED_KEYS: dict[str, type | tuple[type, ...]] = {"run": str, "step": int, "manifest": str}
"""``checkpointed``: the run id, the step written and the SHA-256 of the party's manifest."""
_RUN_ID = re.compile(r"[0-9a-f]{16}")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def _fits_commit(committed: object, step: int, *, resuming: bool, rejoin: bool) -> bool:
    """Whether ``committed``, the label party's last commit in a ``checkpoints``, fits the
    request: the step itself on resume, at or after the step to restore at a rejoin naming one,
    none or a step >= 1 otherwise."""
    if committed is None:
        return not resuming and not (rejoin and step)
    if not isinstance(committed, int) or isinstance(committed, bool):
        return False
    if resuming:
        return committed == step
    return committed >= max(step, 1)


class ServedCheckpoints:
    """A serving data party's own checkpoints (``party serve --checkpoint-dir DIR``): written
    into ``DIR/<name>/step-NNNNNNNN/`` when the label party asks (``checkpoint``), restored
    from there when it resumes a run (``checkpoints`` naming a step; the party serves with
    ``--resume``). Every request is checked (the run id, a step after the last, the label
    party's last commit) and a checkpoint is read back against the manifest SHA-256 the label
    party recorded, so a missing, corrupt, other-run or other-party checkpoint is refused before
    anything trains. Only that SHA-256 leaves the party; nothing is written outside ``DIR``."""

    def __init__(self, name: str, directory: Path | None, *, resume: bool) -> None:
        self.name = name
        self.directory = directory
        self.resume = resume
        self.run: str | None = None
        self.step: int | None = None
        """This party's latest checkpoint of the run (written, or restored), None before."""
        self.joined_after: int | None = None
        """The label party's last commit when this party took the run's checkpoints: None at
        the start of a fresh run, the step on resume, the latest commit when it rejoined."""

    def check_ready(self, kind: str) -> None:
        """ProtocolError for a training message before a party serving with ``--resume`` has
        restored its checkpoint (the label party must resume, not start afresh)."""
        if self.resume and self.run is None:
            raise ProtocolError(
                f"{self.name} serves with --resume: the label party's `checkpoints` naming the "
                f"step to restore expected before training; found a {kind} (run `train "
                "--resume DIR` at the label party, or serve without --resume)."
            )

    def start(self, party: DataParty, body: Mapping[str, Any]) -> dict[str, Any]:
        """Take the run's checkpoints (``body``: :data:`CHECKPOINTS_KEYS`); on resume,
        restore ``party`` from its own checkpoint of the step. At a rejoin naming a step, the
        party (set up anew) restores its checkpoint of that step, the last commit that held it,
        if its directory still has it (a DP party's accountant also takes its journal's
        releases after it), and otherwise keeps its initial models. The answer: the run and
        the step restored (0: none)."""
        run, step, manifest = body["run"], body["step"], body["manifest"]
        committed, rejoin = body["committed"], body["rejoin"]
        if self.run is not None:
            raise ProtocolError(f"{self.name}: a second `checkpoints` of the run (a replay?).")
        if not _RUN_ID.fullmatch(run) or body["every"] < 0:
            raise ProtocolError(
                f"checkpoints: a run id of 16 hex digits and steps between checkpoints >= 0 "
                f"expected; found {run[:40]!r} and {body['every']!r}."
            )
        restoring = step != 0 or manifest is not None
        resuming = restoring and not rejoin
        if restoring and (step < 1 or not _DIGEST.fullmatch(str(manifest))):
            raise ProtocolError(
                f"checkpoints: a step >= 1 and a manifest SHA-256 (64 hex digits) to restore "
                f"expected; found step {step!r}, manifest {str(manifest)[:70]!r}."
            )
        if not _fits_commit(committed, step, resuming=resuming, rejoin=rejoin):
            raise ProtocolError(
                f"{self.name} refuses `checkpoints`: the label party's last commit (the step "
                "resumed from; at a rejoin, one at or after the step to restore; none or a step "
                f">= 1 otherwise) expected; found {committed!r} with step {step!r}."
            )
        if self.directory is None:
            asked = (
                f"resumes from step {step}" if resuming else f"checkpoints every {body['every']}"
            )
            raise ProtocolError(
                f"{self.name}: the label party's run {asked} steps; this party keeps its own "
                "checkpoints, and serves without a directory for them: serve it with "
                "`--checkpoint-dir DIR`."
            )
        if resuming != self.resume:
            asked = (
                f"resumes from step {step}"
                if resuming
                else "readmits it to its run in progress"
                if rejoin
                else "starts a fresh run"
            )
            raise ProtocolError(
                f"{self.name} serves {'with' if self.resume else 'without'} --resume; the label "
                f"party {asked}."
            )
        restored = 0
        kept = restoring and step_directory(self.directory, self.name, step).is_dir()
        if rejoin and restoring and not kept:
            logger.warning(
                "%s: rejoining, it finds no checkpoint of step %d in its checkpoint directory: "
                "it goes on from its initial models",
                self.name,
                step,
            )
        if resuming:
            self._restore(party, run, step, manifest)
            self.step = restored = step
        elif kept:
            self._restore(party, run, step, manifest, rejoining=True)
            restored = step
            logger.warning(
                "%s: rejoining, it restored its checkpoint of step %d (the last commit that held "
                "it) in place of its initial models",
                self.name,
                step,
            )
        elif rejoin and party.accountant is not None:
            try:
                taken = rejoin_from_journal(self.directory, party, run)
            except IntegrityError as error:
                raise ProtocolError(
                    f"{self.name} cannot rejoin under DP without its releases of the run: {error}"
                ) from None
            logger.warning(
                "%s: rejoining under DP, it took back %d release(s) of the run from its journal "
                "(its first process's: its report prices them)",
                self.name,
                taken,
            )
        else:
            start_journal(self.directory, party, run)
        self.run = run
        self.joined_after = committed
        return {"run": run, "step": restored}

    def _restore(
        self, party: DataParty, run: str, step: int, manifest: str, *, rejoining: bool = False
    ) -> None:
        assert self.directory is not None
        try:
            saved = read_checkpoint(
                self.directory, self.name, step, run_id=run, manifest_sha=manifest
            )
            where = str(step_directory(self.directory, self.name, step))
            restore_party_state(
                party,
                saved.tensors,
                saved.meta,
                where=where,
                journal=self.directory,
                run_id=run,
                rejoining=rejoining,
            )
        except (IntegrityError, DataError) as error:
            raise ProtocolError(
                f"{self.name} refuses its checkpoint of step {step} of run {run}: {error}"
            ) from None

    def write(self, party: DataParty, body: Mapping[str, Any]) -> dict[str, Any]:
        """Write ``party``'s checkpoint of the step in ``body`` (:data:`CHECKPOINT_KEYS`),
        keeping the label party's last committed one; the answer carries its manifest's
        SHA-256."""
        run, step, committed = body["run"], body["step"], body["committed"]
        if self.run is None or self.directory is None or run != self.run:
            raise ProtocolError(
                f"checkpoint: the run {self.run} announced by `checkpoints` expected; found run "
                f"{run[:40]!r}."
            )
        expected = self.step if self.step is not None else self.joined_after
        last = expected or 0
        if step <= last or isinstance(committed, bool) or committed != expected:
            raise ProtocolError(
                f"checkpoint: a step after {last} with the last commit {expected} expected; "
                f"found step {step!r}, commit {committed!r} (a replay, or out of order?)."
            )
        tensors, meta = party_state(party)
        digest = write_checkpoint(
            self.directory, self.name, run_id=run, step=step, tensors=tensors, meta=meta
        )
        drop_older(self.directory, self.name, keep=step, also=committed)
        self.step = step
        return {"run": run, "step": step, "manifest": digest}


class DeployedCheckpoints:
    """The label party's side of a deployed run's checkpoints
    (:class:`~secure_vfl.checkpoints.PartiesElsewhere`): each data party writes and restores
    its own, asked by message, and answers with its manifest's SHA-256. The aggregation server
    keeps nothing between steps (its ledgers belong to the session, and a resumed run's
    session and mask keys are fresh), so it is not asked."""

    def __init__(self, endpoint: PartyEndpoint, federation: Federation) -> None:
        self.endpoint = endpoint
        self.names = list(federation.names[1:])
        self.run_id = ""
        self.every = 0
        self.committed: int | None = None
        """The label party's last commit: the resumed step, then each step written (the label
        party writes its own checkpoint right after, or the run fails)."""
        self.held: dict[str, tuple[int, str]] = {}
        """Each party's checkpoint in the last commit that held it: (step, manifest SHA-256);
        a party lost and restarted restores it when it rejoins."""

    def start(self, run_id: str, *, every: int, resume: ResumePoint | None) -> None:
        """Every data party takes the run's checkpoints; on ``resume`` each restores its own
        checkpoint of the step, checked against the manifest SHA-256 recorded for it."""
        self.run_id, self.every = run_id, every
        self.committed = resume.step if resume is not None else None
        lost = resume.dropped if resume is not None else []
        live = [name for name in self.names if name not in lost]
        if resume is not None and sorted(resume.label.parties) != sorted(live):
            raise IntegrityError(
                f"{resume.root}: checkpoints of the data parties {sorted(live)} expected in "
                f"the label party's manifest of step {resume.step} (those lost before it: "
                f"{sorted(lost) or 'none'}), found {sorted(resume.label.parties)}."
            )
        bodies = {
            name: {
                "run": run_id,
                "every": every,
                "step": resume.step if resume is not None else 0,
                "manifest": resume.label.parties[name] if resume is not None else None,
                "committed": self.committed,
                "rejoin": False,
            }
            for name in live
        }
        self._start(bodies)
        if resume is not None:
            self.held = {name: (resume.step, resume.label.parties[name]) for name in live}

    def rejoined(self, name: str) -> int:
        """The data party ``name``, set up anew after it was lost, takes the run's checkpoints
        from the label party's last commit on (its first is the next step written), and
        restores its checkpoint in the last commit that held it, if any (and if its directory
        still has it); a party serving without a checkpoint directory, or with ``--resume``,
        refuses (ProtocolError): it stays lost. Returns the step it restored (0: none, it goes
        on from its initial models)."""
        step, manifest = self.held.get(name, (0, None))
        body = {
            "run": self.run_id,
            "every": self.every,
            "step": step,
            "manifest": manifest,
            "committed": self.committed,
            "rejoin": True,
        }
        return self._start({name: body})[name]

    def _start(self, bodies: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
        """Send each party its ``checkpoints``; the step each restored (a rejoining party may
        have restored none: 0)."""
        ready = self._ask("checkpoints", bodies, "checkpoints-ready", {"run": str, "step": int})
        restored = {}
        for name, reply in ready.items():
            body = bodies[name]
            steps = (body["step"], 0) if body["rejoin"] else (body["step"],)
            if reply["run"] != body["run"] or reply["step"] not in steps:
                expected = {"run": body["run"], "step": " or ".join(map(str, steps))}
                raise ProtocolError(
                    f"checkpoints-ready from {name}: {expected} expected, found {reply}."
                )
            restored[name] = reply["step"]
        return restored

    def write(
        self, step: int, run_id: str, *, committed: int | None, parties: Sequence[str]
    ) -> dict[str, str]:
        """Each of ``parties`` writes its checkpoint of ``step``; their manifests' SHA-256."""
        bodies = {name: {"run": run_id, "step": step, "committed": committed} for name in parties}
        manifests = {}
        written = self._ask("checkpoint", bodies, "checkpointed", CHECKPOINTED_KEYS)
        for name, reply in written.items():
            digest = reply.pop("manifest", None)
            if reply != {"run": run_id, "step": step} or not _DIGEST.fullmatch(str(digest)):
                raise ProtocolError(
                    f"checkpointed from {name}: run {run_id}, step {step} and a manifest SHA-256 "
                    f"expected; found {reply}, manifest {str(digest)[:70]!r}."
                )
            manifests[name] = str(digest)
            self.held[name] = (step, str(digest))
        self.committed = step
        return manifests

    def _ask(
        self,
        topic: str,
        bodies: Mapping[str, Mapping[str, Any]],
        answer: str,
        keys: Mapping[str, type | tuple[type, ...]],
    ) -> dict[str, dict[str, Any]]:
        """Send each party its body of ``topic`` and take its answer of topic ``answer`` (with
        exactly ``keys``), one party after the other: a refusal leaves no answer behind."""
        endpoint = self.endpoint
        handler, endpoint.handler = endpoint.handler, None  # answers wait here, not at the party
        try:
            answers = {}
            for name, body in bodies.items():
                endpoint.send(_deployment(endpoint.name, name, topic, body))
                message = endpoint.receive(sender=name, kind="deployment")
                answers[name] = dict(_body(message, answer, keys))
            return answers
        finally:
            endpoint.handler = handler


# -- saved models: every party keeps its own part -------------------------------------------

SAVE_KEYS: dict[str, type | tuple[type, ...]] = {"run": str}
"""``save``: the model's run id (32 hex digits), which names the party's part directory."""
SAVED_KEYS: dict[str, type | tuple[type, ...]] = {"run": str, "files": dict}
"""``saved``: the run id and the SHA-256 of each file of the party's part, by file name."""
_MODEL_ID = re.compile(r"[0-9a-f]{32}")
_PART_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
MODELS_DIR = "models"
"""A serving data party's default model directory, beside its data file."""


def model_directory(federation: Federation, name: str, given: Path | None) -> Path | None:
    """Where serving party ``name`` keeps its parts of saved models: ``given`` (``party serve
    --model-dir``), else ``models/`` beside its data file; None at the aggregation server, which
    keeps no part (ConfigError if one is given to it)."""
    if name == AGGREGATOR:
        if given is not None:
            raise ConfigError(
                "the aggregation server keeps no part of a model: serve it without --model-dir."
            )
        return None
    data = federation.member(name).data
    return given if given is not None or data is None else data.parent / MODELS_DIR


class ServedModel:
    """A serving data party's own parts of saved models: when the label party asks (``save``,
    naming the model's run id) it writes its part with
    :meth:`~secure_vfl.federation.parties.DataParty.save_part` (an imputation client: its own
    imputer, :meth:`~secure_vfl.deployed_imputation.ServedClient.save_model`) into
    ``DIR/NAME/RUN_ID/``, the
    whole directory atomically (a fresh one renamed into place), and answers with the SHA-256
    of each file: nothing else leaves it, and it writes nothing outside ``DIR``. One save per
    run; a run id already saved there is refused (a replay)."""

    def __init__(self, name: str, directory: Path | None) -> None:
        self.name = name
        self.directory = directory
        self.saved: str | None = None

    def part_directory(self, run: str) -> Path:
        """Where this party's part of model ``run`` lies."""
        assert self.directory is not None
        return self.directory / self.name / run

    def save(
        self, write: Callable[[Path], dict[str, str]], body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Write this party's part of the model ``body`` names (:data:`SAVE_KEYS`) with
        ``write`` (into a fresh directory; it returns each file's SHA-256); the answer
        (:data:`SAVED_KEYS`) carries them."""
        run = body["run"]
        if not _MODEL_ID.fullmatch(run):
            raise ProtocolError(f"save: a run id of 32 hex digits expected; found {run[:40]!r}.")
        if self.saved is not None:
            raise ProtocolError(
                f"{self.name}: a second save of the run (model {run}; it saved model "
                f"{self.saved}): a replay?"
            )
        if self.directory is None:
            raise ProtocolError(f"{self.name} keeps no model directory; it cannot save a part.")
        target = self.part_directory(run)
        if target.exists():
            raise ProtocolError(
                f"{self.name}: its part of model {run} already exists at {target} (a replay?)."
            )
        files: dict[str, str] = {}
        atomic_directory(target, lambda tmp: files.update(write(tmp)))
        self.saved = run
        return {"run": run, "files": files}

    def end(self, outcome: str) -> Path | None:
        """The label party ended the run with ``outcome``: but for those of
        :data:`KEEPS_ITS_PART` it wrote no manifest naming the part this process saved for
        the run (it failed or was stopped before), so the part belongs to no model: it is
        removed, and its directory returned (None: nothing was saved, or it is kept)."""
        if outcome in KEEPS_ITS_PART or self.saved is None:
            return None
        target = self.part_directory(self.saved)
        if target.exists():
            remove_directory(target)
        self.saved = None
        return target


def save_deployed(
    directory: Path,
    endpoint: PartyEndpoint,
    federation: Federation,
    own: DataParty,
    config: Any,
    data: VerticalData,
    lost: Sequence[str],
    unreachable: Callable[[Sequence[str]], list[str]] | None = None,
    runs: list[str] | None = None,
) -> tuple[Manifest, dict[str, str]]:
    """Save a deployed run's model: every live data party writes its own part in its own
    process (``save`` -> ``saved``, its files' SHA-256), the label party ``own`` writes its part
    into ``directory/<name>/`` and the manifest last, listing every party's hashes and where its
    part lies (:data:`~secure_vfl.saved_model.KEPT_BY_PARTY`, or
    :data:`~secure_vfl.saved_model.LOST` for the ``lost`` parties, which saved nothing). The
    model's run id is appended to ``runs`` before any party is asked, so a run that fails
    after can tell whether its manifest got into place (:func:`_saved_run`).

    A party that cannot be reached when asked to save (``unreachable`` says so: its process
    died after the evaluation) is lost here: its part is listed as lost and the others are
    saved. Returns the manifest and, by name, why each party was lost while saving."""
    run = new_run_id()
    if runs is not None:
        runs.append(run)
    names = federation.names
    lost_here: dict[str, str] = {}
    saved: list[Manifest] = []

    def write(staged: Path) -> None:
        entries = [saved_here(staged, own, names[0], 0)]
        handler, endpoint.handler = endpoint.handler, None  # answers wait here, not at the party
        try:
            for name in names[1:]:
                files: dict[str, str] = {}
                if name not in lost:
                    try:
                        files = _ask_save(endpoint, name, run)
                    except ProtocolError as error:
                        if unreachable is None or not unreachable([name]):
                            raise
                        lost_here[name] = str(error)
                        logger.warning(
                            "%s: %s is lost while saving the model; its part is not saved: %s",
                            endpoint.name,
                            name,
                            error,
                        )
                gone = name in lost or name in lost_here
                entries.append(
                    PartEntry(
                        name=name,
                        source=name,
                        role=DATA_PARTY_ROLE,
                        directory=name,
                        files=files,
                        location=LOST if gone else KEPT_BY_PARTY,
                    )
                )
        finally:
            endpoint.handler = handler
        saved.append(
            write_manifest(
                staged,
                entries,
                run_id=run,
                method=config.method,
                seed=config.seed,
                method_config=config.method_config,
                false_vfl=getattr(config, "false_vfl", None),
                data=data,
            )
        )

    replace_directory(directory, write)  # a model saved over another keeps none of its files
    return saved[0], lost_here


def _saved_run(directory: Path) -> str | None:
    """The run id of the manifest in ``directory`` (None: none there, or not readable)."""
    try:
        run = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8")).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run if isinstance(run, str) else None


def _ask_save(endpoint: PartyEndpoint, name: str, run: str) -> dict[str, str]:
    """Party ``name`` saves its part of model ``run``; its files' SHA-256 by file name,
    checked (ProtocolError naming the party otherwise)."""
    endpoint.send(_deployment(endpoint.name, name, "save", {"run": run}))
    reply = _body(endpoint.receive(sender=name, kind="deployment"), "saved", SAVED_KEYS)
    files = reply["files"]
    if (
        reply["run"] != run
        or not files
        or not all(
            isinstance(k, str) and _PART_FILE.fullmatch(k) and _DIGEST.fullmatch(str(v))
            for k, v in files.items()
        )
    ):
        raise ProtocolError(
            f"saved from {name}: run {run} and a SHA-256 (64 hex digits) per plain file name "
            f"expected; found run {str(reply['run'])[:40]!r}, files {sorted(files)[:5]}."
        )
    return {str(k): str(v) for k, v in files.items()}


def _aggregation_server(backend: SumBackend | None) -> Party:
    server = make_aggregation_server(backend)
    if isinstance(backend, SealingScheme):
        server.install(backend.scheme, backend.adder())
    return server


SETUP_KEYS: dict[str, type | tuple[type, ...]] = {
    "method": str,
    "method_config": dict,
    "seed": int,
    "index": int,
    "names": list,
    "secure_agg": str,
    "num_classes": int,
    "block_shapes": list,
    "fit_rows": list,
    "rows": dict,
    "labels": (list, type(None)),
    "align": str,
    "missing_cells": str,
    "false_vfl": (dict, type(None)),
    "privacy": (dict, type(None)),
}


def served_missing_cells(what: str, body: dict[str, Any]) -> str:
    """The policy for empty cells the label party sent in ``body`` (``--missing-cells``), which
    the party applies to its own table; ProtocolError for one it does not know."""
    policy = body["missing_cells"]
    if policy not in MISSING_POLICIES:
        raise ProtocolError(
            f"{what}: `missing_cells` one of {list(MISSING_POLICIES)} expected, found "
            f"{shown(policy)}."
        )
    return str(policy)


def served_privacy(
    name: str, message: Message, party: DataParty, factory: PartyPrivacyFactory | None
) -> ServedPrivacy | None:
    """Data party ``name``'s own half of the privacy layer, built by ``factory`` in its own
    process from the ``privacy`` part of its set-up ``message`` and installed in ``party``
    (None when the run has no DP). ProtocolError for a part this process cannot take."""
    part = _body(message, "setup", SETUP_KEYS)["privacy"]
    if part is None:
        return None
    if factory is None:
        raise ProtocolError(
            f"setup: {name} was sent a privacy plan, but this process offers no DP mechanisms."
        )
    return factory(name, part, party)


def build_served_party(
    name: str,
    message: Message,
    table: PartyTable,
    secure_sums: SecureSums,
    *,
    aligned: np.ndarray | None = None,
) -> DataParty:
    """Data party ``name`` as the set-up ``message`` describes it, from its own ``table``:
    its standardised blocks, its bottom and the method's heads and further bottoms for it (the
    seed rule of the in-process run), its own secure-sum halves. Under the plain join the
    set-up's rows are rows of its table; under PSI (``align: "psi"``) they are positions of
    the aligned samples, which the party maps to its rows by ``aligned`` (its row of each
    aligned sample, -1 where it holds none: what PSI told it). ProtocolError on a set-up that
    does not fit its table or its alignment, or names an unknown method."""
    body = _body(message, "setup", SETUP_KEYS)
    config = served_config("setup", name, body)
    index = body["index"]
    to_rows = _row_mapping(body["align"], aligned, name, table.ids.size)
    n = table.ids.size if aligned is None else aligned.size
    rows = {
        split: to_rows(_rows(value, f"rows.{split}", low=-1, high=n), f"rows.{split}")
        for split, value in body["rows"].items()
    }
    if "train" not in rows:
        raise ProtocolError("setup: the rows of the training split expected.")
    fit_rows = to_rows(_rows(body["fit_rows"], "fit_rows", low=0, high=n), "fit_rows")
    if fit_rows.size == 0:
        raise ProtocolError(f"setup: {name} must hold a training row; found none.")
    shapes = served_shapes("setup", body)
    blocks, preprocessing = party_blocks(
        table,
        fit_rows,
        rows,
        missing_cells=served_missing_cells("setup", body),
        where=f"{name} ({table.name})",
    )
    if shapes[index] != tuple(blocks["train"].shape[1:]):
        raise ProtocolError(
            f"setup: block shape {shapes[index]} announced for {name}, which encodes its "
            f"table to {tuple(blocks['train'].shape[1:])} (the shape it answered the `fit` "
            "with, for the same rows)."
        )
    if body["method"] in LATENT_METHODS and body["labels"] is not None:
        raise ProtocolError(f"setup: {name} holds no label under {body['method']}; found some.")
    labels = {}
    if body["labels"] is not None:
        labels["train"] = torch.from_numpy(
            _rows(body["labels"], "labels", low=0, high=body["num_classes"])
        )
    party = served_models(
        "setup", name, body, config, blocks, rows, shapes, preprocessing, labels=labels
    )
    return _with_secure_sums(party, secure_sums(body["secure_agg"]))


def served_config(where: str, name: str, body: Mapping[str, Any]) -> Any:
    """The method configuration of a set-up ``body`` (``where``: its topic) for party
    ``name``: its place among the names, a deployable method, the bounds on what it may ask
    (:func:`check_requested`). ProtocolError naming what does not fit."""
    from secure_vfl.methods import MethodConfig

    names, index = body["names"], body["index"]
    seen: set[str] = set()
    for k, entry in enumerate(names):
        if not isinstance(entry, str) or not entry or entry in seen:
            again = " twice" if isinstance(entry, str) and entry else ""
            raise ProtocolError(
                f"{where}: `names`, a list of distinct non-empty party names expected; found "
                f"{shown(entry)}{again} (at index {k})."
            )
        seen.add(entry)
    if not 1 <= index < len(names) or names[index] != name:
        raise ProtocolError(f"{where}: {name} expected at index {index} of {shown(names)}.")
    if body["method"] not in DEPLOYED_METHODS:
        raise ProtocolError(f"{where}: a method of {DEPLOYED_METHODS} expected.")
    check_requested(where, body["method_config"], {"representation_dim": MAX_LAYER_WIDTH})
    check_requested(where, body, {"num_classes": MAX_CLASSES})
    if body["num_classes"] < 2:
        raise ProtocolError(
            f"{where}: `num_classes` of at least 2 expected, found {body['num_classes']}."
        )
    try:
        checks.seed("seed", body["seed"])
    except ConfigError as error:
        raise ProtocolError(f"{where}: {error}") from None
    try:
        return MethodConfig(**body["method_config"])
    except (TypeError, ConfigError) as error:
        raise ProtocolError(f"{where}: a valid method configuration expected: {error}") from None


def served_shapes(where: str, body: Mapping[str, Any]) -> list[tuple[int, ...]]:
    """The block shapes of a set-up ``body`` (``where``: its topic), one per party, each a list
    of positive integers; ProtocolError naming what was found otherwise."""
    shapes, names = body["block_shapes"], body["names"]
    if len(shapes) != len(names):
        raise ProtocolError(
            f"{where}: one block shape per party expected ({len(names)}); found {len(shapes)}."
        )
    for shape in shapes:
        if (
            not isinstance(shape, list)
            or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
        ):
            raise ProtocolError(
                f"{where}: `block_shapes` of lists of positive integers expected; found "
                f"{shown(shape)}."
            )
    return [tuple(shape) for shape in shapes]


def served_models(
    where: str,
    name: str,
    body: Mapping[str, Any],
    config: Any,
    blocks: Mapping[str, np.ndarray],
    rows: Mapping[str, np.ndarray],
    shapes: Sequence[tuple[int, ...]],
    preprocessing: PartyPreprocessing | None,
    *,
    labels: Mapping[str, Tensor] | None,
) -> DataParty:
    """Data party ``name`` (at ``body["index"]``) with the models of the method ``body`` names,
    built by the method's seed rule on its ``blocks`` (which of whose rows it holds: ``rows``
    >= 0, per split) as in one process; ``labels``: the training labels of the rows it holds
    where it holds heads (None: a party that only predicts, which needs none). A FALSE-VFL
    party is built by FALSE-VFL's seed rule from the set-up's ``false_vfl`` options and is
    handed no label (only the label party holds labels, and which rows are unlabelled is only
    its to know)."""
    from secure_vfl.methods import PARTY_MODELS
    from secure_vfl.methods.base import build_party
    from secure_vfl.methods.false_vfl import FalseVflConfig, build_latent_party

    index = body["index"]
    tensors = {split: torch.from_numpy(block) for split, block in blocks.items()}
    if body["method"] in LATENT_METHODS:
        widths = dict.fromkeys(("latent_dim", "global_latent_dim", "hidden"), MAX_LAYER_WIDTH)
        check_requested(where, body["false_vfl"] or {}, widths)
        try:
            options = FalseVflConfig(**(body["false_vfl"] or {}))
        except (TypeError, ConfigError) as error:
            raise ProtocolError(f"{where}: valid `false_vfl` options expected: {error}") from None
        return build_latent_party(
            index,
            name,
            method=body["method"],
            blocks=tensors,
            observed={split: torch.from_numpy(held >= 0) for split, held in rows.items()},
            shapes=shapes,
            config=config,
            options=options,
            seed=body["seed"],
            preprocessing=preprocessing,
        )
    if body["false_vfl"] is not None:
        raise ProtocolError(
            f"{where}: `false_vfl` options go with {', '.join(LATENT_METHODS)}; found them with "
            f"{body['method']}."
        )
    models = PARTY_MODELS.get(body["method"])(config, shapes, body["num_classes"], body["seed"])
    if (
        labels is not None
        and models.heads.get(index)
        and labels.get("train", torch.empty(0)).numel() != rows["train"].size
    ):
        raise ProtocolError(f"{where}: {name} holds heads, so the training labels are needed.")
    return build_party(
        index,
        name,
        blocks=tensors,
        observed=rows["train"] >= 0,
        labels=labels or {},
        config=config,
        seed=body["seed"],
        role=ROLES.get("data-party"),
        heads=models.heads.get(index, {}),
        models={key: m for (k, key), m in models.bottoms.items() if k == index},
        preprocessing=preprocessing,
    )


def _with_secure_sums(party: DataParty, backend: SumBackend | None) -> DataParty:
    """``party`` with its own halves of ``backend`` made inside it, if it seals sums."""
    from secure_vfl.methods.base import install_halves

    if isinstance(backend, SealingScheme):
        install_halves(party, backend)
    return party


def fit_served_preprocessing(
    name: str,
    table: PartyTable,
    fit_rows: Any,
    align: str,
    aligned: np.ndarray | None,
    *,
    missing_cells: str,
) -> PartyPreprocessing:
    """Data party ``name``'s preprocessing fitted on the ``fit_rows`` (a message's value: rows
    of its table under the plain join, sample positions under PSI, mapped by ``aligned``) of
    its own ``table``, as :func:`party_blocks` fits it at the set-up; ProtocolError for rows it
    does not hold."""
    to_rows = _row_mapping(align, aligned, name, table.ids.size)
    n = table.ids.size if aligned is None else aligned.size
    rows = to_rows(_rows(fit_rows, "fit_rows", low=0, high=n), "fit_rows")
    if rows.size == 0:
        raise ProtocolError(f"fit: {name} must hold a training row; found none.")
    return PartyPreprocessing.fit(
        table.frame.iloc[rows],
        missing_cells=missing_cells,
        id_column=ID_COLUMN,
        where=f"{name} ({table.name})",
    )


def _row_mapping(
    align: str, aligned: np.ndarray | None, name: str, table_rows: int
) -> Callable[[np.ndarray, str], np.ndarray]:
    """How a set-up's row values become rows of the party's table: as they are (``join``), or
    through ``aligned`` (``psi``: a sample position -> the party's row of that sample).
    ProtocolError if the set-up's alignment is not the one the party took part in, or (on use)
    if a position names a sample the party does not hold."""
    if align not in ("join", "psi") or (align == "psi") != (aligned is not None):
        ran = "PSI" if aligned is not None else "no PSI"
        raise ProtocolError(
            f"setup: {name} ran {ran}; an `align` of 'join' (rows of its table, without PSI) or "
            f"'psi' (sample positions, after PSI) to match expected, found {align!r}."
        )
    if aligned is None:
        return lambda rows, what: rows
    if aligned.size and (aligned.min() < -1 or aligned.max() >= table_rows):
        raise ProtocolError(f"{name}: PSI gave rows outside its table of {table_rows} rows.")
    mapped: np.ndarray = aligned

    def to_rows(positions: np.ndarray, what: str) -> np.ndarray:
        rows = np.where(positions >= 0, mapped[np.maximum(positions, 0)], -1)
        if ((positions >= 0) & (rows < 0)).any():
            raise ProtocolError(
                f"setup: `{what}` places {name} at aligned samples it does not hold (PSI "
                "matched none of its ids there)."
            )
        return rows.astype(np.int64)

    return to_rows


def _endpoint(
    federation: Federation,
    name: str,
    *,
    insecure: bool,
    deadline: float,
    capture: BinaryIO | None = None,
    identity: TlsIdentity | None = None,
) -> PartyEndpoint:
    """Party ``name``'s endpoint at its address, with its own TLS identity (``identity``, else
    :meth:`Federation.identity` checks and reads it; none with ``insecure``), every other
    member as a peer and the members alone as callers; ``capture`` records what crosses it."""
    if insecure:
        identity = None
    elif identity is None:
        identity = federation.identity(name)
    return PartyEndpoint(
        name,
        listen=federation.member(name).address,
        peers=federation.addresses(but=name),
        identity=identity,
        insecure=insecure,
        deadline=deadline,
        capture=capture,
        members=[member.name for member in federation.members],
    )


def _revocation_note(federation: Federation, endpoint: PartyEndpoint) -> str:
    """What a serving party says of the revocation list it applies as it starts (a new one
    put there later is applied, and logged, when it arrives): the file and how many
    certificates it revokes, or that there is none yet and where one would be read; nothing
    without TLS."""
    if endpoint.identity is None:
        return ""
    crl = federation.crl_file()
    if endpoint.identity.crl is None or crl is None:
        watched = endpoint.identity.crl_path
        return " (no certificate revocation list" + (f" yet at {watched})" if watched else ")")
    return f" (revocation list {crl}: {endpoint.revoked_count} revoked)"


def serve(
    federation: Federation,
    name: str,
    *,
    secure_sums: SecureSums,
    deadline: float,
    wait: float,
    insecure: bool = False,
    on_event: Callable[[str], None] = logger.info,
    psi: PsiRoles | None = None,
    psi_only: bool = False,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    model_dir: Path | None = None,
    party_privacy: PartyPrivacyFactory | None = None,
    imputed_dir: Path | None = None,
    statistics_privacy: StatisticsPrivacyFactory | None = None,
    capture: BinaryIO | None = None,
    data: Path | None = None,
) -> str:
    """Serve as ``name`` (a data party or ``aggregator``) until the label party ends the run;
    return the outcome it announced (``on_event`` hears of the set-up). A data party answers
    the label party's ``ids-request`` (the plain join) or, with ``psi``, takes the responder's
    side of its PSI session; ``psi_only`` refuses the ``ids-request`` (its ids never leave it in
    the clear). With ``checkpoint_dir`` it writes its own checkpoints there when the label party
    asks; with ``resume`` it restores one before training (:class:`ServedCheckpoints`). It
    saves its own part of the trained model under ``model_dir`` (default: :func:`model_directory`)
    when the label party asks (:class:`ServedModel`).
    With ``party_privacy`` it installs its own DP mechanisms when its set-up carries a plan (as
    an imputation client, its statistics mechanism with ``statistics_privacy``).
    With ``capture`` it records every message that crosses its endpoint (its own view). It
    serves the table ``data`` (new rows to predict on, say) instead of its federation file's.
    As an imputation client it writes its imputed table under ``imputed_dir`` (default:
    ``imputed/`` beside its data file) when the label party asks.
    TransportError if the label party is silent for longer than ``deadline`` seconds (``wait``
    before its first message) and then accepts no connection within as long (at most
    :data:`~secure_vfl.federation.network.PROBE_SECONDS`; at once if its address refuses the
    connection): its process is gone. A silent label
    party that still accepts one is busy (training without this party, a lost one waiting
    for readmission at the next epoch boundary; a long evaluation), and is waited for again.
    Before it listens, ConfigError for what would fail only later: its own ``data`` file
    missing (:meth:`Federation.own_file`), a directory given that is not one and cannot be
    made (:func:`~secure_vfl.io.check_directory`), a certificate no peer accepts
    (:meth:`Federation.identity`)."""
    if name == federation.label_party:
        raise ConfigError(
            f"{name} is the label party of {federation.path}; it runs `secure-vfl train "
            f"--federation {federation.path} --name {name}`, not `party serve`."
        )
    member = federation.member(name)
    checkpoints = served_checkpoints(name, checkpoint_dir, resume=resume)
    model = ServedModel(name, model_directory(federation, name, model_dir))
    path = data if data is not None else member.data
    if path is not None and name == AGGREGATOR:
        raise ConfigError("the aggregation server holds no table: serve it without --data.")
    if imputed_dir is not None and name == AGGREGATOR:
        raise ConfigError(
            "the aggregation server writes no imputed table: serve it without --imputed-dir."
        )
    if psi_only and name == AGGREGATOR:
        raise ConfigError(
            "the aggregation server holds no ids to align: serve it without --align psi."
        )
    if data is None and member.data is not None:
        federation.own_file(name, "data")
    for option, directory in (
        ("--checkpoint-dir", checkpoint_dir),
        ("--model-dir", model_dir),
        ("--imputed-dir", imputed_dir),
    ):
        if directory is not None:
            check_directory(option, directory)
    identity = None if insecure else federation.identity(name)
    table = read_party_file(path) if path is not None else None
    endpoint = _endpoint(
        federation, name, insecure=insecure, deadline=deadline, capture=capture, identity=identity
    )
    server = _Server(
        federation,
        name,
        endpoint,
        secure_sums,
        table,
        on_event,
        psi,
        psi_only,
        checkpoints,
        model,
        party_privacy=party_privacy,
        imputed_dir=_beside_data(federation, name, imputed_dir, IMPUTED_DIR),
        statistics_privacy=statistics_privacy,
    )
    endpoint.handler = server.receive
    endpoint.redact = private_paths(
        {
            "its data directory": path.parent if path is not None else None,
            "its federation file's directory": federation.path.parent,
            "its model directory": model.directory,
            "its checkpoint directory": checkpoint_dir,
            "its imputed directory": server.imputed_dir,
        }
    )
    on_event(f"{name}: serving at {member.address}{_revocation_note(federation, endpoint)}")
    label = federation.label_party
    start = time.monotonic()
    heard = False  # a message from the label party came
    seen = False  # before that, the label party's process accepted a connection
    try:
        while server.outcome is None:
            # Before the first message, looked at every `deadline` seconds too (up to `wait`):
            # a restarted party never readmitted is left waiting once its run has ended.
            left = wait - (time.monotonic() - start)
            silence = deadline if heard or seen else max(min(deadline, left), 0.001)
            awaiting = f"{'' if heard else 'first '}message from the label party {label}"
            try:
                endpoint.act_on_next(silence, awaiting=awaiting)
            except TransportError as error:
                # A whole probe even where the last look before --wait's end was short.
                probe = min(PROBE_SECONDS, max(silence, min(deadline, wait)))
                if not endpoint.await_peers([label], probe, refused_is_lost=True):
                    seen = True
                    on_event(
                        f"{name}: the label party {label} was silent for {silence:g} s but "
                        "accepts connections: waiting on"
                    )
                    continue
                if not (heard or seen) and time.monotonic() - start < wait:
                    continue  # not up yet: parties may start in any order
                if heard:
                    why = "did it die?"
                elif seen:
                    why = (
                        "it accepted them before, and sent this party nothing: its run ended or "
                        "stopped without taking this party back, or it died"
                    )
                else:  # it never came up: nothing to say it died
                    why = "is it started, at the address of the federation file?"
                waited = wait if not (heard or seen) else silence
                raise TransportError(
                    f"{name}: the label party {label} was silent for {waited:g} s and accepts "
                    f"no connection ({why}): {error}"
                ) from None
            heard = True
    finally:
        endpoint.close()
    return server.outcome


def private_paths(directories: Mapping[str, Path | None]) -> Callable[[str], str]:
    """What a serving party's refusals say to the label party: each of its own ``directories``
    (by what they are: "its model directory", ...) replaced by that name in angle brackets, so
    that its file system's layout stays on its machine (its own log keeps the paths). Each is
    matched as given and resolved; the deepest first, so a directory inside another is named as
    itself."""
    forms: dict[str, str] = {}
    for what, directory in directories.items():
        if directory is None:
            continue
        for form in (str(directory), str(directory.resolve())):
            if Path(form).is_absolute() and form != Path(form).anchor:  # never "/" or "."
                forms.setdefault(form, f"<{what}>")
    ordered = sorted(forms.items(), key=lambda item: -len(item[0]))

    def redact(text: str) -> str:
        for form, named in ordered:
            text = text.replace(form, named)
        return text

    return redact


IMPUTED_DIR = "imputed"
"""Where a served imputation client writes its imputed tables by default, beside its data."""


def _beside_data(
    federation: Federation, name: str, given: Path | None, default: str
) -> Path | None:
    """``given``, else ``default`` beside party ``name``'s data file (None without one)."""
    data = federation.member(name).data
    return given if given is not None or data is None else data.parent / default


def served_checkpoints(name: str, directory: Path | None, *, resume: bool) -> ServedCheckpoints:
    """The checkpoints of serving party ``name``; ConfigError, before it serves, for the
    aggregation server (it keeps nothing between steps) or a ``resume`` without a checkpoint of
    ``name`` in ``directory``."""
    if name == AGGREGATOR and (directory is not None or resume):
        raise ConfigError(
            "the aggregation server keeps nothing between steps (a resumed run sets up fresh "
            "sessions and keys): serve it without --checkpoint-dir and --resume."
        )
    if resume and directory is None:
        raise ConfigError(f"--resume needs --checkpoint-dir DIR (where {name}'s are). Found none.")
    if resume and directory is not None and not written_steps(directory, name):
        raise ConfigError(
            f"--resume: a checkpoint of {name} expected under {directory / name}; found none."
        )
    return ServedCheckpoints(name, directory, resume=resume)


# -- the label party: driving the run --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LabelSide:
    """What the label party knows before training: its data view and the plan of rows."""

    data: VerticalData
    plan: RowPlan
    widths: list[int]


def check_rosters(endpoint: PartyEndpoint, federation: Federation, names: Sequence[str]) -> None:
    """Have each of ``names`` compare the label party's federation file with its own copy
    (:meth:`Federation.roster`), all at once, before anything else of the run: a copy that
    differs is refused there, naming how, rather than failing later in transit."""
    roster = federation.roster()
    endpoint.send_all([_deployment(endpoint.name, name, "roster", roster) for name in names])


def collect_ids(
    endpoint: PartyEndpoint, federation: Federation, names: Sequence[str] | None = None
) -> tuple[list[Any], list[int]]:
    """Every data party's (or those ``names``) ids and block width, asked for by message (the
    plain join); ProtocolError, naming the party, for ids that are not distinct non-empty
    text, as its party file holds them."""
    ids, widths = [], []
    for name in federation.names[1:] if names is None else names:
        endpoint.send(_deployment(endpoint.name, name, "ids-request", {}))
        message = endpoint.receive(sender=name, kind="deployment")
        body = _body(message, "ids", {"ids": list, "width": int})
        if not all(isinstance(i, str) for i in body["ids"]) or body["width"] < 1:
            raise ProtocolError(f"ids from {name}: text ids and a width >= 1 expected.")
        held = np.asarray(body["ids"], dtype=str)
        unique, counts = np.unique(held, return_counts=True)
        empty = unique.size > 0 and unique[0] == ""  # sorted: an empty id comes first
        if empty or unique.size != held.size:
            found = "''" if empty else f"{shown(str(unique[counts > 1][0]))} more than once"
            raise ProtocolError(
                f"ids from {name}: distinct non-empty text ids expected (as its party file "
                f"holds them); found {found}."
            )
        ids.append(held)
        widths.append(body["width"])
    return ids, widths


def fitted_widths(
    endpoint: PartyEndpoint,
    federation: Federation,
    plan: RowPlan,
    align: str,
    missing_cells: str = DEFAULT_MISSING_POLICY,
) -> list[int]:
    """Every data party's model-input width, asked for by message once the plan is drawn:
    each fits its own preprocessing on its planned training rows (:data:`fit`) and answers
    with its block's shape, which is all it tells of its columns."""
    widths = []
    for k, name in enumerate(federation.names[1:], start=1):
        body = {
            "fit_rows": plan.fit_rows[k].tolist(),
            "align": align,
            "missing_cells": missing_cells,
        }
        endpoint.send(_deployment(endpoint.name, name, "fit", body))
        reply = _body(endpoint.receive(sender=name, kind="deployment"), "fitted", {"shape": list})
        shape = reply["shape"]
        if len(shape) != 1 or not isinstance(shape[0], int) or not 1 <= shape[0] <= MAX_INPUT_WIDTH:
            raise ProtocolError(
                f"fitted from {name}: the shape of a tabular block, [width] with 1 <= width <= "
                f"{MAX_INPUT_WIDTH}, expected; found {str(shape)[:60]}."
            )
        widths.append(shape[0])
    return widths


def join_alignment(own: PartyTable, ids: Sequence[np.ndarray]) -> AlignLabelIds:
    """The plain join of the label party's ids with its own table's and every party's ids
    (collected in the clear by :func:`collect_ids`)."""
    sizes = [own.ids.size, *[party.size for party in ids]]
    return lambda label_ids: (JoinAligner().align([own.ids, *ids], label_ids), sizes)


def start_psi(
    endpoint: PartyEndpoint, federation: Federation, names: Sequence[str] | None = None
) -> tuple[dict[str, str], list[int]]:
    """Ask every data party (or those ``names``) to take the responder's side of a PSI session
    (a fresh session id each, the mode :data:`PSI_MODE`); returns the sessions by party and the
    parties' block widths, which is all they answer."""
    sessions, widths = {}, []
    for name in federation.names[1:] if names is None else names:
        sessions[name] = secrets.token_hex(16)
        body = {"session": sessions[name], "mode": PSI_MODE}
        endpoint.send(_deployment(endpoint.name, name, "psi", body))
        reply = _body(endpoint.receive(sender=name, kind="deployment"), "psi-ready", {"width": int})
        if reply["width"] < 1:
            raise ProtocolError(f"psi-ready from {name}: a width >= 1 expected.")
        widths.append(reply["width"])
    return sessions, widths


class PsiAlignment:
    """The label party's alignment by PSI over the network (an
    :data:`~secure_vfl.data.vertical.AlignLabelIds`): its own table joined locally, every data
    party through its PSI session (:func:`start_psi`), one after the other, then each party
    told where its matched ids sit among the aligned samples. The alignment's rows of a data
    party are those sample positions (the label party never learns the party's rows); the party
    maps them to its rows (:func:`build_served_party`). The same samples, in the same order, as
    the plain join and the in-process PSI. A party restarted after it was lost aligns again
    with :meth:`realign`."""

    def __init__(
        self,
        endpoint: PartyEndpoint,
        own: PartyTable,
        sessions: Mapping[str, str],
        roles: PsiRoles,
    ) -> None:
        self.endpoint = endpoint
        self.own = own
        self.sessions = dict(sessions)
        self.roles = roles
        self._label_ids = np.zeros(0)
        self._sample_of = np.zeros(0, dtype=np.int64)
        self._held = np.zeros((0, len(sessions)), dtype=bool)
        self._samples = 0

    def __call__(self, label_ids: np.ndarray) -> tuple[Alignment, list[int]]:
        endpoint, own = self.endpoint, self.own
        label_ids = np.asarray(label_ids)
        check_unique_ids(label_ids, "label party")
        own_rows = np.full(label_ids.size, -1, dtype=np.int64)
        local = JoinAligner().align([own.ids], label_ids)
        own_rows[local.label_rows] = local.rows[:, 0]
        requester = self.roles.requester(label_ids, endpoint.name)
        endpoint.handler = None  # the channel attaches the requester to the endpoint
        requester.connect(NetworkChannel(endpoint))
        try:
            held, sizes = _intersect_each(requester, self.sessions, label_ids.size)
            label_order = np.argsort(label_ids, kind="stable")
            kept = (held[label_order].any(axis=1)) | (own_rows[label_order] >= 0)
            label_rows = label_order[kept].astype(np.int64)
            sample_of = np.full(label_ids.size, -1, dtype=np.int64)
            sample_of[label_rows] = np.arange(label_rows.size, dtype=np.int64)
            for peer in self.sessions:
                requester.send_matches(peer, sample_of, int(label_rows.size))
        finally:
            endpoint.handler = None  # the training channel attaches the label party next
        self._label_ids, self._sample_of, self._held = label_ids, sample_of, held
        self._samples = int(label_rows.size)
        # A data party's "rows" are sample positions; the label party's own are its rows.
        rows = np.where(held[label_rows], sample_of[label_rows][:, None], -1)
        alignment = Alignment(
            sample_ids=label_ids[label_rows],
            rows=np.column_stack([own_rows[label_rows], rows]).astype(np.int64),
            label_rows=label_rows,
            dropped=int((~kept).sum()),
        )
        return alignment, [own.ids.size, *sizes]

    def realign(self, name: str) -> None:
        """PSI again with data party ``name``, a new process after it was lost (its PSI state
        died with the old one), in a fresh session: the run's intersection expected (the same
        ids: ProtocolError otherwise), then the party told where its matched ids sit, as at the
        start. Its set-up follows."""
        endpoint = self.endpoint
        k = list(self.sessions).index(name)
        session = secrets.token_hex(16)
        handler, endpoint.handler = endpoint.handler, None  # the answers wait here
        try:
            body = {"session": session, "mode": PSI_MODE}
            endpoint.send(_deployment(endpoint.name, name, "psi", body))
            _body(endpoint.receive(sender=name, kind="deployment"), "psi-ready", {"width": int})
            requester = self.roles.requester(self._label_ids, endpoint.name)
            endpoint.handler = None
            requester.connect(NetworkChannel(endpoint))
            result = requester.intersect(name, session_id=session, mode=PSI_MODE)
            found = None if result.indices is None else np.sort(result.indices)
            expected = np.flatnonzero(self._held[:, k])
            if found is None or not np.array_equal(found, expected):
                reason = (
                    f"PSI with {name} again: the run's intersection of {expected.size} ids "
                    f"expected; found {'its size only' if found is None else found.size} (its "
                    "ids changed since the alignment?)."
                )
                endpoint.handler = None
                self._turn_away(name, reason)
                raise ProtocolError(reason)
            requester.send_matches(name, self._sample_of, self._samples)
        finally:
            endpoint.handler = handler
        self.sessions[name] = session

    def _turn_away(self, name: str, reason: str) -> None:
        """End the run for the restarted party ``name``, saying why it is not readmitted: it
        exits (non-zero) at once, instead of waiting for the next epoch's probe, which would
        only find it aligned already (a process runs PSI once)."""
        outcome = f"not readmitted: {reason}"
        self.endpoint.send(_deployment(self.endpoint.name, name, "end", {"outcome": outcome}))
        _body(self.endpoint.receive(sender=name, kind="deployment"), "report", REPORT_KEYS)


def _intersect_each(
    requester: PsiRequesting, sessions: Mapping[str, str], label_ids: int
) -> tuple[np.ndarray, list[int]]:
    """PSI with each party of ``sessions`` in turn: (label_ids, parties) bool, whether party k
    holds each of the label party's ids, and each party's number of ids."""
    held = np.zeros((label_ids, len(sessions)), dtype=bool)
    sizes = []
    for k, (peer, session_id) in enumerate(sessions.items()):
        result = requester.intersect(peer, session_id=session_id, mode=PSI_MODE)
        if result.indices is None:
            raise ProtocolError(f"PSI with {peer}: the intersection expected, not its size.")
        held[result.indices, k] = True
        sizes.append(int(result.peer_size))
    return held, sizes


def label_side(
    config: Any,
    federation: Federation,
    own: PartyTable,
    align: AlignLabelIds,
    widths: list[int],
    encoded: Callable[[RowPlan], list[int]] | None = None,
    labels: LabelTable | None = None,
) -> LabelSide:
    """The label party's plan of rows (``align``: :func:`join_alignment` or
    :class:`PsiAlignment`) and its view of the data: the labels, the masks, its own
    standardised block and, for the other parties, blocks of their shape that hold nothing
    (zero-strided: the method reads their shapes only). The plan reads the parties' column
    counts ``widths`` (for its shapes only); the blocks take the widths ``encoded`` gives for
    the plan (each party's model input once its own preprocessing is fitted on its planned
    training rows, :func:`fitted_widths`), or ``widths`` without it. ``labels``: the label
    file as the label party read it before contacting anyone (None: read here)."""
    member = federation.member(federation.label_party)
    assert member.labels is not None
    plan = plan_rows_by(
        align,
        [len(own.columns), *widths],
        member.labels,
        train_missing=parse_mechanism(config.train_missing),
        test_missing=[parse_mechanism(text) for text in config.test_missing],
        test_fraction=config.test_fraction if config.test_fraction is not None else 0.2,
        test_file=config.test_file,
        rng=np.random.default_rng(config.seed),
        names=federation.names,
        labels_read=labels,
    )
    blocks, preprocessing = party_blocks(
        own,
        plan.fit_rows[0],
        {split: rows[:, 0] for split, rows in plan.rows.items()},
        missing_cells=config.missing_cells,
        where=f"{member.data} ({federation.label_party})",
    )
    if encoded is not None:
        widths = encoded(plan)
    all_widths = [blocks["train"].shape[1], *widths]

    def split(name: str) -> VerticalSplit:
        n = plan.rows[name].shape[0]
        others = [np.broadcast_to(np.float32(0), (n, w)) for w in all_widths[1:]]
        return VerticalSplit(
            blocks=(blocks[name], *others), labels=plan.labels[name], mask=plan.mask(name)
        )

    data = VerticalData(
        name=member.labels.stem,
        kind="tabular",
        num_classes=len(plan.classes),
        train=split("train"),
        tests={name: split(name) for name in plan.rows if name != "train"},
        dropped=dict(plan.dropped),
        preprocessing=(preprocessing, *[None] * len(widths)),
        classes=plan.classes,
    )
    return LabelSide(data, plan, all_widths)


def setup_bodies(
    config: Any,
    side: LabelSide,
    federation: Federation,
    secure_agg: str,
    privacy: Mapping[str, dict[str, Any] | None] | None = None,
) -> dict[str, dict[str, Any]]:
    """The ``setup`` body of every data party and of the aggregator; ``privacy`` gives each
    data party's plan for its own DP mechanisms (:func:`privacy_plans`; none by default)."""
    from secure_vfl.methods import PARTY_MODELS

    method_config = dataclasses.asdict(config.method_config)
    data = side.data
    models = PARTY_MODELS.get(config.method)(
        config.method_config, data.block_shapes, data.num_classes, config.seed
    )
    bodies: dict[str, dict[str, Any]] = {AGGREGATOR: {"secure_agg": secure_agg}}
    for k, name in enumerate(federation.names):
        if k == 0:
            continue
        labels = None
        if models.heads.get(k):
            held = side.plan.rows["train"][:, k] >= 0
            labels = np.where(held, side.plan.labels["train"], 0).tolist()
        bodies[name] = {
            "method": config.method,
            "method_config": method_config,
            "seed": config.seed,
            "index": k,
            "names": federation.names,
            "secure_agg": secure_agg,
            "num_classes": data.num_classes,
            "block_shapes": [list(shape) for shape in data.block_shapes],
            "fit_rows": side.plan.fit_rows[k].tolist(),
            "rows": {split: rows[:, k].tolist() for split, rows in side.plan.rows.items()},
            "labels": labels,
            "align": config.align,
            "missing_cells": config.missing_cells,
            "false_vfl": _false_vfl_options(config),
            "privacy": (privacy or {}).get(name),
        }
    return bodies


def privacy_plans(
    config: Any,
    side: LabelSide,
    federation: Federation,
    privacy: DeployedPrivacy | None,
    resume: ResumePoint | None = None,
) -> dict[str, dict[str, Any] | None]:
    """Each data party's plan for its own DP mechanisms (None without DP), decided by the label
    party's ``privacy`` before any party is set up: the Poisson sample drawn for the method's
    training batches (on ``resume``, the killed run's, from the label party's checkpoint),
    SIGMA calibrated to it, as in one process."""
    from secure_vfl.methods.base import training_sampler

    if privacy is None:
        return {name: None for name in federation.names[1:]}
    data = side.data
    return privacy.plan_parties(
        training_sampler(config.method, data, config.method_config, config.seed),
        n=data.train.n,
        epochs=config.method_config.epochs,
        method=config.method,
        method_config=config.method_config,
        names=federation.names,
        predictions=len(data.tests),  # each test record is released once per split
        resumed=resumed_schedule(resume) if resume is not None else None,
    )


def _false_vfl_options(config: Any) -> dict[str, Any] | None:
    """FALSE-VFL's options as a set-up carries them (null: its defaults); None for another
    method."""
    if config.method not in LATENT_METHODS:
        return None
    options = getattr(config, "false_vfl", None)
    return dataclasses.asdict(options) if options is not None else None


def refuse_undeployable(config: Any) -> None:
    """ConfigError, before any work, for what a deployed run does not offer."""
    if config.method not in DEPLOYED_METHODS:
        raise ConfigError(
            f"--federation runs {', '.join(DEPLOYED_METHODS)}. Found --method {config.method}."
        )
    if config.dataset is not None:
        raise ConfigError(
            "--federation reads each party's data from the federation file; drop --dataset."
        )
    if config.align not in ("join", "psi"):
        raise ConfigError(
            f"--federation aligns by the plain join (the label party learns every party's ids) "
            f"or by PSI (--align psi: it learns only which of its ids each party holds). Found "
            f"--align {config.align}."
        )
    own_file_options = {
        "--id-column": config.id_column != ID_COLUMN,
        "--label-column": config.label_column != LABEL_COLUMN,
        "--party-name": bool(config.party_names),
    }
    chosen = [flag for flag, given in own_file_options.items() if given]
    if chosen:
        raise ConfigError(
            f"--federation takes the parties' names from the federation file and the columns "
            f"`{ID_COLUMN}` and `{LABEL_COLUMN}`; found {', '.join(chosen)} (not offered with "
            "--federation yet)."
        )
    for text in (config.train_missing, *config.test_missing):
        mechanism = parse_mechanism(text)
        if mechanism.name not in ("mcar", "beta", "dirichlet"):
            raise ConfigError(
                f"--federation draws missingness from shapes only (mcar, beta, dirichlet): "
                f"MAR and MNAR read every party's features. Found {mechanism.label}."
            )


def train_deployed(
    config: Any,
    federation: Federation,
    name: str,
    *,
    secure_agg: str,
    secure_sums: SecureSums,
    deadline: float,
    wait: float = 60.0,
    insecure: bool = False,
    on_start: Callable[[int], None] | None = None,
    on_step: Callable[[int, float], None] | None = None,
    psi: PsiRoles | None = None,
    checkpoints: CheckpointPlan | None = None,
    model_dir: Path | None = None,
    privacy: DeployedPrivacy | None = None,
    capture: BinaryIO | None = None,
) -> Any:
    """Run ``config`` (a :class:`~secure_vfl.experiment.TrainConfig` without data files) as
    the label party ``name`` of ``federation``: wait up to ``wait`` seconds for every other
    party to accept a connection (they may start after it), align (collect ids for the plain
    join, or under ``config.align == "psi"`` run PSI with each party by ``psi``'s roles), plan
    the rows, set every party up, train, evaluate and end the run. Returns the
    :class:`~secure_vfl.experiment.TrainResult`, its traffic counting every party's bytes
    (each reports its own). ``checkpoints`` (its ``resume`` found by the label party's own
    checkpoint) has every data party write its own every ``every`` steps, and on resume restore
    its own before anything trains (:class:`DeployedCheckpoints`). With ``model_dir`` the
    trained model is saved at the end, every live data party keeping its own part
    (:func:`save_deployed`). ``privacy`` (the label
    party's privacy engine) plans every party's DP mechanisms before it sets them up
    (:func:`privacy_plans`): each data party installs its own in its own process and reports
    what its accountant priced at the end, which ``privacy`` adds to the result's report. Under
    DP a lost party is readmitted only in a run with ``checkpoints`` (it takes its releases back
    from its journal; without checkpoints they died with its process). ``capture`` records
    every message that crosses the label party's endpoint."""
    from secure_vfl.experiment import run_training
    from secure_vfl.methods.base import SAVING, in_process_parties, lost_parties

    refuse_undeployable(config)
    if config.align == "psi" and psi is None:
        raise ConfigError("--align psi with --federation needs the PSI roles (protocols.psi).")
    if name != federation.label_party:
        raise ConfigError(
            f"{name} is not the label party of {federation.path} ({federation.label_party} "
            f"is); {'the aggregation server' if name == AGGREGATOR else 'a data party'} runs "
            f"`secure-vfl party serve --federation {federation.path} "
            f"--name {name}`."
        )
    # Its own files and certificate first: nothing else would find them wrong before every
    # peer has connected.
    federation.label_data()  # the keys: ConfigError saying that training needs them
    data = federation.own_file(name, "data")
    federation.own_file(name, "labels")
    labels = read_label_file(federation.labels())  # before any peer: what plans the rows
    identity = None if insecure else federation.identity(name)
    own = read_party_file(data)
    endpoint = _endpoint(
        federation,
        name,
        insecure=insecure,
        deadline=deadline,
        capture=capture,
        identity=identity,
    )
    outcome = "failed"
    saved_runs: list[str] = []  # the model's run id, once the parties are asked to save
    reports: dict[str, Counter[tuple[str, str, str]]] = {}
    entries: dict[str, Any] = {}
    lost: list[str] = []
    late: list[str] = []
    channel: NetworkChannel | None = None
    try:
        late = endpoint.await_peers_or_warn(list(federation.addresses(but=name)), wait)
        check_rosters(endpoint, federation, [m.name for m in federation.members[1:]])
        align: AlignLabelIds
        if config.align == "psi":
            assert psi is not None
            sessions, widths = start_psi(endpoint, federation)
            align = PsiAlignment(endpoint, own, sessions, psi)
        else:
            ids, widths = collect_ids(endpoint, federation)
            align = join_alignment(own, ids)
        side = label_side(
            config,
            federation,
            own,
            align,
            widths,
            encoded=lambda plan: fitted_widths(
                endpoint, federation, plan, config.align, config.missing_cells
            ),
            labels=labels,
        )
        resume = checkpoints.resume if checkpoints is not None else None
        plans = privacy_plans(config, side, federation, privacy, resume)
        bodies = setup_bodies(config, side, federation, secure_agg, plans)
        # A party lost before the resumed checkpoint stays lost: set up only if it rejoins.
        lost_before = resume.dropped if resume is not None else []
        for receiver, body in bodies.items():
            if receiver in lost_before:
                continue
            endpoint.send(
                _deployment(name, receiver, "setup", body), deadline=max(deadline, SETUP_DEADLINE)
            )
        elsewhere = None
        if checkpoints is not None:
            elsewhere = checkpoints_elsewhere(checkpoints, endpoint, federation)
            checkpoints = dataclasses.replace(checkpoints, elsewhere=elsewhere)
        channel = NetworkChannel(endpoint)
        channel.party_names = federation.names
        # Lost before the resumed checkpoint: never set up, so left out of the key set-up too
        # (asked for its keys, it refused them as a party never set up, and the run stopped).
        channel.absent = frozenset(lost_before)
        # Under DP a rejoining party takes back its releases from its journal, which it keeps
        # beside its checkpoints: without checkpoints its accountant died with its process.
        if not any(plans.values()) or elsewhere is not None:
            channel.readmit = readmission(
                endpoint,
                bodies,
                deadline=deadline,
                checkpoints=elsewhere,
                realign=_realignment(align, lost_before)
                if isinstance(align, PsiAlignment)
                else None,
            )
        steps = [0]  # the training steps done, which date a party lost while saving

        def counted(step: int, loss: float) -> None:
            steps[0] = step
            if on_step is not None:
                on_step(step, loss)

        result = run_training(
            config,
            data=side.data,
            channel=channel,
            aggregator=secure_sums(secure_agg) or PlainAggregator(),
            privacy=privacy,
            on_start=on_start,
            on_step=counted,
            checkpoints=checkpoints,
        )
        lost = lost_parties(result.faults)
        if model_dir is not None:
            own_party = in_process_parties(channel)[0]
            if secure_agg != "none":  # so that a prediction sums them as training did (F29)
                plan = side.plan
                own_party.training_samples = TrainingSamples.of(
                    plan.ids["train"], plan.mask("train")
                )
            _, lost_saving = save_deployed(
                model_dir,
                endpoint,
                federation,
                own_party,
                config,
                side.data,
                lost,
                unreachable=channel.unreachable,
                runs=saved_runs,
            )
            epoch = len(result.epoch_loss)  # the last, counted as the faults count them
            saving = [
                {"party": party, "step": steps[0], "epoch": epoch, "phase": SAVING, "what": what}
                for party, what in lost_saving.items()
            ]
            result = dataclasses.replace(result, faults=[*result.faults, *saving])
            lost = [*lost, *lost_saving]
        outcome = "finished"
    finally:
        if outcome != "finished" and channel is not None:  # stopped: those lost until now
            lost = sorted(channel.lost_now)
        if (  # stopped once its manifest, which names every part, was in place
            outcome != "finished"
            and saved_runs
            and model_dir is not None
            and _saved_run(model_dir) == saved_runs[0]
        ):
            outcome = SAVED_THEN_STOPPED
        reports, entries = _end(endpoint, federation, outcome, lost=lost, late=late)
        endpoint.close()
    if privacy is not None:
        privacy.take_reports(entries)
        result = dataclasses.replace(result, privacy=privacy.report())
    return dataclasses.replace(
        result,
        traffic=_with_reports(result.traffic, reports),
        # Each actor carries its party's name from the federation file (in one process: party-k).
        parties={name: name for name in federation.names},
    )


def readmission(
    endpoint: PartyEndpoint,
    bodies: Mapping[str, Mapping[str, Any]],
    *,
    deadline: float,
    checkpoints: DeployedCheckpoints | None = None,
    realign: Callable[[str], None] | None = None,
) -> Readmission:
    """How the label party sets a lost data party up again when it answers at an epoch
    boundary (a new ``party serve`` process of the same name, certificate and address, started
    by its operator): the ``setup`` it had at the start of the run (:func:`rejoin_setup`), after
    which it builds itself as it did then, and, in a run with ``checkpoints``, the run's
    checkpoints from the last commit on (:meth:`DeployedCheckpoints.rejoined`); under PSI,
    ``realign`` aligns it again first (:func:`_realignment`). ProtocolError if the party
    refuses any of them."""

    def readmit(name: str) -> int:
        if realign is not None:
            realign(name)
        body = rejoin_setup(bodies[name])
        endpoint.send(
            _deployment(endpoint.name, name, "setup", body),
            deadline=max(deadline, SETUP_DEADLINE),
        )
        return checkpoints.rejoined(name) if checkpoints is not None else 0

    return readmit


def _realignment(align: PsiAlignment, aligned: Sequence[str]) -> Callable[[str], None]:
    """How a lost party is aligned again before it rejoins under PSI: by a new PSI session
    (:meth:`PsiAlignment.realign`), but for the parties ``aligned`` in this process's
    alignment and never set up (lost before a resumed checkpoint): they hold this alignment
    already, the first time they are readmitted."""
    pending = set(aligned)

    def realign(name: str) -> None:
        if name in pending:
            pending.discard(name)
        else:
            align.realign(name)

    return realign


def rejoin_setup(body: Mapping[str, Any]) -> dict[str, Any]:
    """The set-up a rejoining data party is sent: the one it had at the start of the run, so it
    rebuilds its initial models by the seed rule (the models it trained died with its process;
    in a run with deployed checkpoints it then restores its own checkpoint in the last commit
    that held it: :meth:`DeployedCheckpoints.rejoined`)."""
    return dict(body)


def checkpoints_elsewhere(
    plan: CheckpointPlan, endpoint: PartyEndpoint, federation: Federation
) -> DeployedCheckpoints:
    """The data parties as ``plan``'s parties elsewhere, each told the run's checkpoints (and
    on resume restored from its own) before anything trains."""
    elsewhere = DeployedCheckpoints(endpoint, federation)
    elsewhere.start(plan.run_id, every=plan.every, resume=plan.resume)
    return elsewhere


REPORT_KEYS: dict[str, type | tuple[type, ...]] = {"bytes": list, "privacy": (dict, type(None))}
"""``report``: the bytes the party sent and what its own accountant priced (null: no DP)."""
INTERRUPTED = "interrupted"
"""The outcome a data party is told when the label party's operator stopped the run."""
SAVED_THEN_STOPPED = "stopped after the model was saved"
"""The outcome a data party is told when the run failed or was stopped once the label party's
manifest naming every part was in place: the model is whole, so each party keeps its part
(on any other failure it removes it, :meth:`ServedModel.end`)."""
KEEPS_ITS_PART = ("finished", SAVED_THEN_STOPPED)
"""The outcomes after which a data party keeps the part of the model it saved."""
FAILED_END_SECONDS = 5.0
"""How long a run that failed or was interrupted waits for each party to take its end: a party
that does not answer by then (hung, or stopped) is only warned of, not waited for the whole
``--deadline`` while the user who pressed Ctrl-C sees nothing."""


def _end(
    endpoint: PartyEndpoint,
    federation: Federation,
    outcome: str,
    *,
    lost: Sequence[str] = (),
    late: Sequence[str] = (),
) -> tuple[dict[str, Counter[tuple[str, str, str]]], dict[str, Any]]:
    """Tell every party but the ``lost`` ones the run is over and take its report (best effort
    after a failure): the bytes each sent, and each data party's privacy entry (None: no DP).
    Called from a ``finally``: where the run is ending because its operator stopped it (Ctrl-C
    or SIGTERM, in flight), the parties are told ``"interrupted"`` rather than ``"failed"``.
    ``late``: the parties the start-up already warned were not reachable, and the one whose loss
    the error in flight reports; one the failed run cannot end (still not reachable) is not
    warned of again."""
    stopping = sys.exc_info()[1]
    if outcome == "failed" and stopping is not None and not isinstance(stopping, Exception):
        outcome = INTERRUPTED
    reports = {}
    entries = {}
    endpoint.handler = None
    names = [member.name for member in federation.members[1:] if member.name not in lost]
    ends = [_deployment(endpoint.name, name, "end", {"outcome": outcome}) for name in names]
    if outcome == "finished":
        bodies = {}
        for name, end in zip(names, ends, strict=True):
            endpoint.send(end)
            bodies[name] = _body(
                endpoint.receive(sender=name, kind="deployment"), "report", REPORT_KEYS
            )
    else:
        seconds = min(endpoint.deadline, FAILED_END_SECONDS)
        # The party whose loss failed the run: its error says so, the end need not warn again.
        cause = stopping.party if isinstance(stopping, TransportError) else None
        bodies = _end_failed(endpoint, names, ends, seconds, late=[*late, cause] if cause else late)
    for name, body in bodies.items():
        reports[name] = _reported_bytes(name, body["bytes"])
        if name != AGGREGATOR:
            entries[name] = body["privacy"]
    return reports, entries


def _end_failed(
    endpoint: PartyEndpoint,
    names: Sequence[str],
    ends: Sequence[Message],
    seconds: float,
    *,
    late: Sequence[str] = (),
) -> dict[str, Any]:
    """The ends of a run that failed or was interrupted, sent to every party at once and their
    reports taken within ``seconds`` in all: hung or stopped parties are only warned of, and
    cost the user that wait once, not once each. A party acts on its end, and answers with its
    report, before its delivery returns, so the reports of those reached are already here."""
    until = time.monotonic() + seconds
    failed: dict[str, ProtocolError] = {}
    try:
        endpoint.send_all(ends, deadline=seconds, failed=failed)
    except SecureVFLError as error:  # each party not reached is named below
        logger.debug("%s: not every party took its end: %s", endpoint.name, error)
    bodies = {}
    for name in names:
        if name in failed:  # it refused its end, or could not be reached: it says which
            unheard = name in late and isinstance(failed[name], TransportError)
            logger.log(
                logging.DEBUG if unheard else logging.WARNING,
                "%s: could not end the run at %s: %s",
                endpoint.name,
                name,
                failed[name],
            )
            continue
        try:
            message = endpoint.receive(
                max(until - time.monotonic(), 0.0), sender=name, kind="deployment"
            )
            while getattr(message, "topic", "report") != "report":  # an earlier request's
                # answer, still in flight when the run stopped (a checkpoint's): skipped, as
                # the party sends its report after it
                message = endpoint.receive(
                    max(until - time.monotonic(), 0.0), sender=name, kind="deployment"
                )
            bodies[name] = _body(message, "report", REPORT_KEYS)
        except TransportError:  # the wait is shared: say what it was, not what was left of it
            logger.warning(
                "%s: could not end the run at %s: it did not answer within %g s (hung, stopped, "
                "or unreachable)",
                endpoint.name,
                name,
                seconds,
            )
        except SecureVFLError as error:
            logger.warning("%s: could not end the run at %s: %s", endpoint.name, name, error)
    return bodies


def _reported_bytes(name: str, entries: list[Any]) -> Counter[tuple[str, str, str]]:
    """The bytes party ``name`` reports it sent, as ``[sender, receiver, phase, count]`` lists
    (sender: itself); ProtocolError naming the first entry that is not one."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for entry in entries:
        if not (
            isinstance(entry, list)
            and len(entry) == 4
            and all(isinstance(text, str) for text in entry[:3])
            and type(entry[3]) is int
            and entry[3] >= 0
        ):
            raise ProtocolError(
                f"report from {name}: bytes as [sender, receiver, phase, count >= 0] expected, "
                f"found {json.dumps(entry)[:80]}."
            )
        sender, receiver, phase, count = entry
        if sender != name:
            raise ProtocolError(f"report from {name}: bytes sent by {sender!r}.")
        counts[(sender, receiver, phase)] += count
    return counts


def _with_reports(
    traffic: dict[str, Any], reports: Mapping[str, Counter[tuple[str, str, str]]]
) -> dict[str, Any]:
    """``traffic`` (the label party's own bytes) with every other party's reported bytes."""
    totals = {party: dict(phases) for party, phases in traffic.get("bytes", {}).items()}
    for counts in reports.values():
        for (sender, _, phase), count in counts.items():
            entry = totals.setdefault(sender, {"train": 0, "predict": 0})
            entry[phase] = entry.get(phase, 0) + count
    steps = max(int(traffic.get("train_steps", 1)), 1)
    return {
        **traffic,
        "bytes": dict(sorted(totals.items())),
        "bytes_per_step": {p: v.get("train", 0) / steps for p, v in sorted(totals.items())},
        "transport": "grpc",
    }
