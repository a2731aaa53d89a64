"""Ray: the cluster and the plan, one Ray Train run per trial (trial), the Tune grid (sweep), fit's
searches (fit, search_trial). The only layer that imports Ray."""
