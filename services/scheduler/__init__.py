"""The scheduler: admits requests to devices under a policy from the shared registry, within GMG memory."""
