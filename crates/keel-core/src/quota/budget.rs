//! Budgets: a key's tokens or spend per UTC day or calendar month, reserved *before* a request
//! is sent so that concurrent requests cannot together overspend, and settled with the real
//! amount when the answer ends.
//!
//! Amounts are integers (tokens, or spend in micro-dollars) so sums are exact. Wall-clock time
//! (`now_unix` seconds) is passed in.

/// Which calendar window a budget covers (UTC).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Window {
    Day,
    Month,
}

impl Window {
    /// The window holding `now_unix`: (start, end) in Unix seconds.
    pub fn bounds(self, now_unix: u64) -> (u64, u64) {
        const DAY: u64 = 86_400;
        let day_start = now_unix - now_unix % DAY;
        match self {
            Window::Day => (day_start, day_start + DAY),
            Window::Month => {
                let (y, m, _) = civil_from_days((now_unix / DAY) as i64);
                let start = days_from_civil(y, m, 1) as u64 * DAY;
                let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                (start, days_from_civil(ny, nm, 1) as u64 * DAY)
            }
        }
    }
}

/// One budget's account for its current window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Account {
    /// Start of the window the amounts belong to.
    pub window_start: u64,
    /// Settled amounts.
    pub spent: u64,
    /// Held by requests in flight.
    pub reserved: u64,
}

/// Why a reservation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exhausted {
    /// What the window still had free.
    pub available: u64,
    /// Seconds until the window ends and the budget is whole again.
    pub retry_after_secs: u64,
}

impl Account {
    /// Rolls the account into the window holding `now_unix` (a new window starts empty;
    /// reservations still in flight carry over, since they will settle in it).
    fn roll(&mut self, window: Window, now_unix: u64) {
        let (start, _) = window.bounds(now_unix);
        if start != self.window_start {
            self.window_start = start;
            self.spent = 0;
        }
    }

    /// Holds `amount` if `spent + reserved + amount ≤ limit`.
    pub fn reserve(
        &mut self,
        limit: u64,
        window: Window,
        now_unix: u64,
        amount: u64,
    ) -> Result<(), Exhausted> {
        self.roll(window, now_unix);
        let used = self.spent.saturating_add(self.reserved);
        if used.saturating_add(amount) > limit {
            let (_, end) = window.bounds(now_unix);
            return Err(Exhausted {
                available: limit.saturating_sub(used),
                retry_after_secs: end - now_unix,
            });
        }
        self.reserved = self.reserved.saturating_add(amount);
        Ok(())
    }

    /// Replaces a reservation by the real amount (which may be larger: it is spent anyway).
    pub fn settle(&mut self, window: Window, now_unix: u64, reserved: u64, actual: u64) {
        self.reserved = self.reserved.saturating_sub(reserved);
        self.roll(window, now_unix);
        self.spent = self.spent.saturating_add(actual);
    }

    /// What is left in the window holding `now_unix`.
    pub fn remaining(&self, limit: u64, window: Window, now_unix: u64) -> u64 {
        let mut a = *self;
        a.roll(window, now_unix);
        limit.saturating_sub(a.spent.saturating_add(a.reserved))
    }
}

/// Days since 1970-01-01 for a proleptic Gregorian date (H. Hinnant's algorithm).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day number (inverse of [`days_from_civil`]).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    // 2026-11-30T12:00:00Z and neighbours.
    const NOV_30_NOON: u64 = 1_796_040_000;

    #[test]
    fn calendar_windows() {
        assert_eq!(civil_from_days(NOV_30_NOON as i64 / 86_400), (2026, 11, 30));
        let (start, end) = Window::Month.bounds(NOV_30_NOON);
        assert_eq!(civil_from_days(start as i64 / 86_400), (2026, 11, 1));
        assert_eq!(civil_from_days(end as i64 / 86_400), (2026, 12, 1));
        assert_eq!(end - start, 30 * 86_400);
        let (start, end) = Window::Month.bounds(days_from_civil(2028, 2, 29) as u64 * 86_400 + 5);
        assert_eq!(end - start, 29 * 86_400, "leap February");
        let (start, end) = Window::Day.bounds(NOV_30_NOON);
        assert_eq!((NOV_30_NOON - start, end - NOV_30_NOON), (43_200, 43_200));
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        for z in -800_000..800_000i64 {
            if z % 997 == 0 {
                let (y, m, d) = civil_from_days(z);
                assert_eq!(days_from_civil(y, m, d), z);
            }
        }
    }

    #[test]
    fn concurrent_reservations_cannot_overspend() {
        let mut a = Account::default();
        // A budget of 1,000 and eleven requests each reserving 100 before any settles.
        let ok = (0..11)
            .filter(|_| a.reserve(1_000, Window::Day, NOV_30_NOON, 100).is_ok())
            .count();
        assert_eq!(ok, 10);
        assert_eq!(
            a.reserve(1_000, Window::Day, NOV_30_NOON, 1),
            Err(Exhausted {
                available: 0,
                retry_after_secs: 43_200
            })
        );
        // They used 40 each: 600 come back.
        for _ in 0..10 {
            a.settle(Window::Day, NOV_30_NOON, 100, 40);
        }
        assert_eq!(a.remaining(1_000, Window::Day, NOV_30_NOON), 600);
        assert!(a.reserve(1_000, Window::Day, NOV_30_NOON, 600).is_ok());
        assert!(a.reserve(1_000, Window::Day, NOV_30_NOON, 1).is_err());
    }

    #[test]
    fn a_new_window_starts_empty_and_keeps_what_is_in_flight() {
        let mut a = Account::default();
        a.reserve(1_000, Window::Day, NOV_30_NOON, 300).unwrap();
        a.settle(Window::Day, NOV_30_NOON, 300, 900);
        a.reserve(1_000, Window::Day, NOV_30_NOON, 100).unwrap();
        assert_eq!(a.remaining(1_000, Window::Day, NOV_30_NOON), 0);
        let tomorrow = NOV_30_NOON + 86_400;
        // The 100 still in flight counts against tomorrow, where it will settle.
        assert_eq!(a.remaining(1_000, Window::Day, tomorrow), 900);
        a.settle(Window::Day, tomorrow, 100, 50);
        assert_eq!(a.remaining(1_000, Window::Day, tomorrow), 950);
    }
}
