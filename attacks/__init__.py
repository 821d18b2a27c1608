"""Attacks from the VFL survey, run as auditors: an attacker is one party playing a registered
role with only its own view; the auditor (:func:`attacks.runner.run_attack`) grants its side
knowledge and scores it against the ground truth, with the defended model's accuracy.

Importing this package registers every attack (:data:`attacks.base.ATTACKS`) and the roles the
attackers play (in the core's role registry).
"""

from attacks import backdoor as backdoor
from attacks import label_inference as label_inference
from attacks import model_completion as model_completion
from attacks import norm_filter as norm_filter
from attacks import reconstruction as reconstruction
from attacks.base import ATTACKS as ATTACKS
from attacks.base import Attack as Attack
from attacks.base import AttackContext as AttackContext
