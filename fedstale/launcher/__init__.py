"""The launcher: everything that starts, deploys or reads runs from outside the two apps
(the `fedstale` CLI, the local SuperLink, deployment, in-process local mode, compare).
It may import both apps; neither app imports it."""
