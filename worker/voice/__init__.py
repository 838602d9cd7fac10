"""The voice-cloning job on top of the core: the message and its input policy, the handler that
claims, trains and persists in commit order, the artifacts in S3, and the records stores."""
