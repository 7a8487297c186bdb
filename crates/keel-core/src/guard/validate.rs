//! Checksums and issuance rules that separate real identifiers from look-alikes.

/// The Luhn (mod 10) check over ASCII digits; any other byte fails.
pub fn luhn_valid(digits: &[u8]) -> bool {
    if digits.is_empty() {
        return false;
    }
    let mut sum = 0u32;
    for (i, &b) in digits.iter().rev().enumerate() {
        if !b.is_ascii_digit() {
            return false;
        }
        let mut d = u32::from(b - b'0');
        if i % 2 == 1 {
            d *= 2;
            if d > 9 {
                d -= 9;
            }
        }
        sum += d;
    }
    sum.is_multiple_of(10)
}

/// Whether `digits` (13 to 19 ASCII digits) is a length that an issuer whose range it falls in
/// uses: Visa, Mastercard, American Express, Discover, JCB, Diners Club, UnionPay, Maestro.
pub fn card_issuer_ok(digits: &[u8]) -> bool {
    let n = digits.len();
    let prefix = |k: usize| -> u32 {
        digits[..k.min(n)]
            .iter()
            .fold(0, |a, &b| a * 10 + u32::from(b - b'0'))
    };
    let (p1, p2, p3, p4) = (prefix(1), prefix(2), prefix(3), prefix(4));
    match p1 {
        4 => matches!(n, 13 | 16 | 19),
        5 if (51..=55).contains(&p2) => n == 16,
        5 if p2 == 50 || (56..=58).contains(&p2) => (12..=19).contains(&n),
        2 if (2221..=2720).contains(&p4) => n == 16,
        3 if p2 == 34 || p2 == 37 => n == 15,
        3 if (3528..=3589).contains(&p4) => (16..=19).contains(&n),
        3 if (300..=305).contains(&p3) || p2 == 36 || p2 == 38 || p2 == 39 => {
            (14..=19).contains(&n)
        }
        6 if p4 == 6011 || p2 == 65 || (644..=649).contains(&p3) => (16..=19).contains(&n),
        6 if p2 == 62 => (16..=19).contains(&n),
        6 if p2 == 67 || p2 == 63 => (12..=19).contains(&n),
        _ => false,
    }
}

/// The IBAN length of a country (ISO 13616 registry), for the countries in common use.
pub(crate) fn iban_length(country: &[u8]) -> Option<usize> {
    Some(match country {
        b"AD" | b"CZ" | b"ES" | b"MD" | b"PK" | b"RO" | b"SA" | b"SE" | b"SK" | b"TN" | b"VG" => 24,
        b"AE" | b"BG" | b"DE" | b"GB" | b"GE" | b"IE" | b"ME" | b"RS" => 22,
        b"AT" | b"BA" | b"EE" | b"KZ" | b"LT" | b"LU" | b"XK" => 20,
        b"BE" => 16,
        b"CH" | b"HR" | b"LI" | b"LV" => 21,
        b"CY" | b"HU" | b"PL" => 28,
        b"DK" | b"FI" | b"FO" | b"GL" | b"NL" => 18,
        b"FR" | b"GR" | b"IT" | b"MC" | b"MR" | b"SM" => 27,
        b"GI" | b"IL" => 23,
        b"IS" | b"TR" => 26,
        b"MT" => 31,
        b"NO" => 15,
        b"PT" => 25,
        b"SI" => 19,
        b"BR" => 29,
        _ => return None,
    })
}

/// ISO 13616 validation of a compact IBAN (no spaces): a known country, its length, and the
/// ISO 7064 mod-97 check (remainder 1).
pub fn iban_valid(iban: &[u8]) -> bool {
    if iban.len() < 15 || iban.len() > 34 {
        return false;
    }
    if iban_length(&iban[..2]) != Some(iban.len()) || !iban[2..4].iter().all(u8::is_ascii_digit) {
        return false;
    }
    let mut rem: u32 = 0;
    for &b in iban[4..].iter().chain(&iban[..4]) {
        let v = match b {
            b'0'..=b'9' => u32::from(b - b'0'),
            b'A'..=b'Z' => u32::from(b - b'A') + 10,
            _ => return false,
        };
        rem = if v >= 10 {
            (rem * 100 + v) % 97
        } else {
            (rem * 10 + v) % 97
        };
    }
    rem == 1
}

/// US SSN issuance rules over the nine digits: area not 000, 666 or 900-999; group not 00;
/// serial not 0000.
pub fn ssn_valid(digits: &[u8]) -> bool {
    if digits.len() != 9 || !digits.iter().all(u8::is_ascii_digit) {
        return false;
    }
    let num = |r: &[u8]| r.iter().fold(0u32, |a, &b| a * 10 + u32::from(b - b'0'));
    let (area, group, serial) = (num(&digits[..3]), num(&digits[3..5]), num(&digits[5..]));
    area != 0 && area != 666 && area < 900 && group != 0 && serial != 0
}
