"""Building blocks shared by the target model and the drafters."""
