"""Graders: one implementation for the graders API, eval runs and reinforcement fine-tuning rewards.

    spec        the grader shapes (OpenAI's, plus json_schema), validated once
    template    {{item.*}} / {{sample.*}} references
    similarity  text metrics equal to rapidfuzz, sacrebleu, nltk and rouge-score on the same strings
    formula     `multi` formulas, parsed with ast and evaluated over a whitelist (never eval)
    models      the served-model interface model graders call (a judge, an embeddings model)
    run         grade(): one sample, one grader -> a Grade (score, passed, OpenAI's error flags)
Imports neither torch nor any web framework.
"""

from core.graders.models import JudgeReply, ModelCallFailed, Models
from core.graders.run import AnyGrader, Grade, grade, threshold_of
from core.graders.spec import GRADER, Grader, MultiGrader
from core.graders.template import render, sample_namespace

__all__ = ["GRADER", "AnyGrader", "Grade", "Grader", "JudgeReply", "ModelCallFailed", "Models", "MultiGrader",
           "grade", "render", "sample_namespace", "threshold_of"]
