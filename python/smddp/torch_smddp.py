"""Alias for SageMaker's idiom ``import smdistributed.dataparallel.torch.torch_smddp``:
``import smddp.torch_smddp`` registers the "smddp" backend the same way."""
import smddp  # noqa: F401  (importing registers the backend)
