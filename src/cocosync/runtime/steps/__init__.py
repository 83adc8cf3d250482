"""The fast forms of plan steps; `prepare.prepare` picks the one for a step (or None: stage by stage)."""
