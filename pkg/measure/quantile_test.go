package measure

import (
	"math"
	"slices"
	"testing"
)

func TestQuantile(t *testing.T) {
	tests := map[string]struct {
		values []float64
		q      float64
		want   float64
	}{
		"empty is NaN":             {values: nil, q: 0.5, want: math.NaN()},
		"one value":                {values: []float64{3}, q: 0.99, want: 3},
		"median of odd":            {values: []float64{5, 1, 3}, q: 0.5, want: 3},
		"median of even is lower":  {values: []float64{4, 1, 3, 2}, q: 0.5, want: 2},
		"just above a rank":        {values: []float64{1, 2, 3, 4}, q: 0.51, want: 3},
		"p99 of 10 is the maximum": {values: []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, q: 0.99, want: 10},
		"p90 of 10":                {values: []float64{10, 9, 8, 7, 6, 5, 4, 3, 2, 1}, q: 0.9, want: 9},
		"q 0 is the minimum":       {values: []float64{2, 1}, q: 0, want: 1},
		"q 1 is the maximum":       {values: []float64{2, 1}, q: 1, want: 2},
		"q above 1 clamps":         {values: []float64{2, 1}, q: 2, want: 2},
		// 0.07·100 is 7.000000000000001 in floating point: still rank 7.
		"float rounding": {values: seq(100), q: 0.07, want: 7},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			in := slices.Clone(tc.values)
			got := Quantile(in, tc.q)
			if !(got == tc.want || math.IsNaN(got) && math.IsNaN(tc.want)) {
				t.Errorf("Quantile(%v, %v) = %v, want %v", tc.values, tc.q, got, tc.want)
			}
			if !slices.Equal(in, tc.values) {
				t.Errorf("Quantile changed its input to %v", in)
			}
		})
	}
}

// seq returns 1..n.
func seq(n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = float64(i + 1)
	}
	return out
}

func TestZeroIfNaN(t *testing.T) {
	if got := ZeroIfNaN(math.NaN()); got != 0 {
		t.Errorf("ZeroIfNaN(NaN) = %v", got)
	}
	if got := ZeroIfNaN(1.5); got != 1.5 {
		t.Errorf("ZeroIfNaN(1.5) = %v", got)
	}
}
