"""The paper's math as pure functions over tensors (they import only torch): group-relative
advantages and their estimator table (advantages.py), the policy losses and their table
(losses.py), GAE and the critic's losses (value.py). Tested against hand-computed numbers."""
