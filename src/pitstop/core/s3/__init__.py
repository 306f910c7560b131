"""Object storage: key names, commit and lease records, and the S3 client's settings (retry
schedule, AWS profile precedence)."""
