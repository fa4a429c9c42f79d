"""An external Flower app whose clients attack Pollen's WeightAveraging (issue 19's hostile suite)."""
