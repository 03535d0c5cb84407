"""fleetscope: differential observability for distributed training."""
