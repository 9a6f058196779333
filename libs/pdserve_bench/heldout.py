"""A held-out English text for quality measurements (``pdserve bench kvquant``): written for
this repository in December 2026, so no model's training data contains it."""

TEXT = """\
The ferry to the northern islands leaves from the old harbour twice a day, once at dawn and
once in the late afternoon, and in the winter months it is often the only way anyone reaches
the outer villages. Marta had worked on it for eleven years before she was given the wheel.
She knew every rock that showed at low tide and every current that pulled against the hull
when the wind came from the west, and she kept a notebook in which she wrote down, each
evening, what the sea had done that day and what she had done in answer.

Most of the passengers were people she knew by name: the schoolteacher who crossed on Mondays
and came back on Fridays, the two brothers who repaired boats and always argued about engines,
the doctor who visited the islands once a month with a bag that seemed far too small for
everything it had to hold. In the summer there were visitors as well, who stood at the rail
taking photographs of the cliffs and asked her whether she ever grew tired of the view. She
told them the truth, which was that the view was different every morning, and that she grew
tired only of the paperwork.

The paperwork had grown over the years. There were forms for the cargo, forms for the fuel,
forms for the inspections that arrived every spring, and a new form, introduced the previous
autumn, on which the captain was asked to estimate how many passengers would travel in the
coming week. Marta found this form the most difficult of all. The number depended on the
weather, on the prices at the market, on whether a wedding or a funeral had been announced,
and on a hundred other things that no one could know in advance. She began to keep a second
notebook in which she compared her guesses with what actually happened, and after a few months
she noticed that her errors were not random. She guessed too high after sunny weekends and
too low after storms, as if her own mood leaked into the numbers.

So she changed her method. Instead of guessing, she wrote down the counts of the last four
weeks, removed the highest and the lowest, and took the average of the two that remained. To
this she added a small correction for the school holidays and another for the fish market,
which drew traders from the islands every second Thursday. The new numbers were not perfect,
but they were better, and more importantly they were the same whether she had slept well or
badly. The harbour office, which had complained about her estimates for months, stopped
complaining without ever saying why.

In the spring the inspectors came as usual. They measured the life jackets, tested the radio,
and climbed down into the engine room with their lamps and their clipboards. One of them, a
young man on his first inspection, noticed the notebooks on the shelf above the chart table
and asked what they were. Marta showed him the first one, with its years of tides and winds,
and then the second one, with its columns of guesses and counts. He read them for a long time
without speaking. When he finally handed them back he asked whether she would mind if he
copied the method for the other ferries on the coast, and she said that she would not mind
at all, provided that he also copied the correction for the fish market, because that was the
part everyone forgot.
"""
