//! The hub: topics, subscribers, slow-consumer policies, batches, retained log, priorities, stats.
