"""A discrete-event simulator of rlboost that runs the manager's own policy code.

SIMULATION, not measurement. Modules: ``events`` (the clock), ``config`` (workload, costs,
policy, prices), ``turns`` (a step's responses, agentic ones in model turns with tool
calls between), ``engine`` (a rollout instance's continuous batching), ``fleet`` (reserved and
trace-driven spot instances, weight pulls, billing), ``simulator`` (the step protocol with
:mod:`manager_svc.seeding` and :mod:`manager_svc.placement` deciding), ``outcome`` (one
policy's result over a measured span) and ``ideal`` (the bounds no scheduler can beat).
Contract: no I/O and no wall clock anywhere in it; services' I/O modules are never imported
(an import-linter contract holds it).
"""
