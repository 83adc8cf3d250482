"""ShadowSync data: the Criteo-format reader (`criteo`, line-aligned byte ranges in `ranges`), the synthetic teacher
(`synth`), MovieLens-100K as clicks (`movielens`); `sources` turns a run's config into each trainer's reader shards
and the held-out set; `plan` moves the unread rows onto another shard count when a run resumes on other trainer or
worker counts."""
